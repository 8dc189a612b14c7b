"""Deployment infrastructure: the WAN link emulator, NATS server configs, the launcher."""
