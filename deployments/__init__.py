"""The Ray Serve layer: app builder, HTTP ingress, router, replica and CLI."""
