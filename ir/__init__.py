"""The IR: tensors, dtypes, the closed op set of the Kimi K3 / Kimi Linear family, the graph
(networkx), its verifier and printer, and a CPU interpreter giving every op its reference semantics."""
