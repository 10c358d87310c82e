"""The test suite: real broker, real ClickHouse engine, real Bytewax and Megatron-Core on CPU."""
