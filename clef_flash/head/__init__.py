"""head"""
