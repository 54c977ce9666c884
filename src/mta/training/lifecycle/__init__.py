"""mta.training.lifecycle"""
