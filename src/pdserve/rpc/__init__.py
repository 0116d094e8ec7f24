"""The gRPC edge: conversions, the error interceptor, server and channel set-up."""
