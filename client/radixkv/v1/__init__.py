"""Generated gRPC code for radixkv.v1 (do not edit; `make proto` regenerates)."""
