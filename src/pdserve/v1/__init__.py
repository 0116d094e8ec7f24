"""Generated from protos/pdserve/v1 by grpcio-tools (make proto); never edit by hand."""
