"""mooncaked.kv"""
