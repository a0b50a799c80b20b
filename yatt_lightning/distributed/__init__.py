"""The distributed plumbing: object collectives, bytes on the wire, failing together, seeding."""
