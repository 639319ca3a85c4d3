"""regattn.train"""
