"""Running the deployment topology locally (network namespaces, processes)."""
