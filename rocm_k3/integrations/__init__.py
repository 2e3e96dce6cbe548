"""Integrations of rocm-k3 into other serving engines (imported only by those engines)."""
