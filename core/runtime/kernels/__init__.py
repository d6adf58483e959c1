"""(floor)"""
