"""mta.store"""
