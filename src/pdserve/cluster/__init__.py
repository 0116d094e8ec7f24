"""Running workers as processes (Ray actors) and the cluster around them."""
