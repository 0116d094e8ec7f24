"""pdserve services: the router and the workers. Each imports pdserve, never another service."""
