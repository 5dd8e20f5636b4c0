# shardkit_free_port: prints a TCP port of 127.0.0.1 that nothing listens on now (the kernel's pick for a socket bound
# to port 0, then closed), for a MASTER_PORT of ranks started by hand. Another process may take it before the ranks
# bind it: the store then fails to listen and says so. Sourced by scripts/misuse and the script tests.
shardkit_free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
