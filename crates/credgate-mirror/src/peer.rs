//! Who is on the other end of a loopback TCP connection: the uid that owns the client's socket,
//! read from the kernel's socket table (`/proc/net/tcp`, `/proc/net/tcp6`). The client's socket
//! is the one whose local address is the connection's peer address and whose remote address is
//! the mirror's own; in the node's network namespace that row is the kernel's word for who
//! opened it (a hostNetwork pod's too, as the node sees its uid).

use std::net::{IpAddr, SocketAddr};

/// The most of a socket table read: far beyond any node's connection count.
const MAX_TABLE: u64 = 64 << 20;

/// The uid owning the client's end of the connection from `peer` to `local`, when the kernel
/// lists it (established).
pub fn uid_of(peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    let file = match peer.ip() {
        IpAddr::V4(_) => "/proc/net/tcp",
        IpAddr::V6(_) => "/proc/net/tcp6",
    };
    let table = read_bounded(file)?;
    find_uid(&table, peer, local)
}

fn read_bounded(path: &str) -> Option<String> {
    use std::io::Read as _;
    let mut text = String::new();
    std::fs::File::open(path)
        .ok()?
        .take(MAX_TABLE)
        .read_to_string(&mut text)
        .ok()?;
    Some(text)
}

/// An address as the kernel's socket table prints it: the address in 32-bit words of the
/// host's byte order, in hex, then the port in hex.
fn kernel_form(addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        IpAddr::V4(v4) => format!("{:08X}", u32::from_ne_bytes(v4.octets())),
        IpAddr::V6(v6) => v6
            .octets()
            .chunks(4)
            .map(|w| format!("{:08X}", u32::from_ne_bytes([w[0], w[1], w[2], w[3]])))
            .collect(),
    };
    format!("{ip}:{:04X}", addr.port())
}

/// The uid of the established socket in `table` whose local address is `peer` and remote
/// address is `local`.
pub fn find_uid(table: &str, peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    let (client, server) = (kernel_form(peer), kernel_form(local));
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // sl local rem st tx:rx tr:when retrnsmt uid ...
        if fields.len() > 7 && fields[1] == client && fields[2] == server && fields[3] == "01" {
            fields[7].parse().ok()
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clients_row_gives_the_uid() {
        let peer: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:5005".parse().unwrap();
        let (c, s) = (kernel_form(peer), kernel_form(local));
        let table = format!(
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
             \x20  0: {s} 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n\
             \x20  1: {s} {c} 01 00000000:00000000 00:00000000 00000000     0        0 2 1\n\
             \x20  2: {c} {s} 06 00000000:00000000 00:00000000 00000000  1001        0 3 1\n\
             \x20  3: {c} {s} 01 00000000:00000000 00:00000000 00000000  1000        0 4 1\n"
        );
        // The server's own row (uid 0) and a closing socket of the same address are not it.
        assert_eq!(find_uid(&table, peer, local), Some(1000));
        let other: SocketAddr = "127.0.0.1:40001".parse().unwrap();
        assert_eq!(find_uid(&table, other, local), None);
    }

    #[test]
    fn addresses_read_as_the_kernel_prints_them() {
        if cfg!(target_endian = "little") {
            assert_eq!(
                kernel_form("127.0.0.1:8080".parse().unwrap()),
                "0100007F:1F90"
            );
            assert_eq!(
                kernel_form("[::1]:80".parse().unwrap()),
                "00000000000000000000000001000000:0050"
            );
        }
    }

    /// A real connection on this machine: the kernel's row names this process's uid.
    #[test]
    fn a_real_loopback_connection_names_its_owner() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_server, peer) = listener.accept().unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        assert_eq!(
            uid_of(peer, listener.local_addr().unwrap()),
            Some(rustix::process::geteuid().as_raw())
        );
    }
}
