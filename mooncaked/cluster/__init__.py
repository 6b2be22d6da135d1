"""Who is in the cluster: the membership interface, static lists and etcd."""
