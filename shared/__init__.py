"""The project's common library: model loading, the block-KV engine, the KV wire format."""
