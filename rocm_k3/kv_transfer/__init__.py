"""Prefill/decode disaggregation: moving a prompt's MLA latent KV blocks and KDA state between instances.

- ``base``: the connector interface, in the shape of vLLM's KV connector (a scheduler half and a worker half),
  with the KDA recurrent + short-conv state as one more transfer group beside the MLA latent KV blocks.
- ``checksum``: the digest each transferred block and state carries (xxhash, or blake2b without it).
- ``socket_transport``: a TCP transport on loopback (a producer-side block store and a consumer-side client).
- ``socket_scheduler``: ``SocketConnector``'s scheduler half (integers only; the N - 1 boundary convention).
- ``socket_connector``: ``SocketConnector``'s worker half over that transport.
- ``nixl_transport`` / ``nixl_connector``: ``NixlConnector``: the same store, its payloads read by NIXL (UCX).
- ``workers``: the worker half a config names.
- ``config``: the validated ``--kv-transfer-config`` (vLLM's keys).
"""
