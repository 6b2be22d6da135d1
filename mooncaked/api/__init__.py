"""mooncaked.api"""
