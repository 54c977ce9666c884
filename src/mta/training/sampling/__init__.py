"""mta.training.sampling"""
