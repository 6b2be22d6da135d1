"""mooncaked.bench"""
