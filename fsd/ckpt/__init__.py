"""The checkpoint mount: writes accepted at memory speed, striped over devices, durable at fsync."""
