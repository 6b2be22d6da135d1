"""The conductor's view of the cluster: stores' keys, instances' load and predictors, outages."""
