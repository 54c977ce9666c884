"""mta.training.config"""
