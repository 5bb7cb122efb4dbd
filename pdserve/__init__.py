"""pdserve: disaggregated prefill/decode LLM serving over gRPC.

Sub-packages:
  core  the shared engine pieces (model, KV layout, sampling, tokenizer, config); imports no
        service and no generated protobuf code.
  rpc   what the services share at the gRPC edge (conversions, server bootstrap).
  v1    generated from proto/pdserve/v1 by `python -m pdserve.build_proto` (git-ignored).
"""
