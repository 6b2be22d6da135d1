"""mooncaked.model"""
