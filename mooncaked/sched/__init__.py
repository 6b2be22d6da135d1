"""mooncaked.sched"""
