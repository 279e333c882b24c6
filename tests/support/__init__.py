"""Support code shared by the test directories (and the soak run): `daemon` runs a real
radixkv daemon as a subprocess and holds the bounded waits that go with it."""
