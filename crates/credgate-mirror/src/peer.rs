//! Who is on the other end of a loopback TCP connection: the uid that owns the client's socket,
//! asked of the kernel with one `sock_diag` request (`NETLINK_SOCK_DIAG`, `SOCK_DIAG_BY_FAMILY`)
//! for that exact socket: the one whose local address is the connection's peer address and
//! whose remote address is the mirror's own. In the node's network namespace its answer is the
//! kernel's word for who opened it (a hostNetwork pod's too, as the node sees its uid).
//!
//! Not `/proc/net/tcp`: the kernel prints that table from a walk of its hash table that sockets
//! coming and going can shift, and on this project's rig a third of the rows of live
//! connections were missing from reads of it (decision 0029).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use rustix::net::{netlink, AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType};

/// `SOCK_DIAG_BY_FAMILY`, the request and answer type.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `NLMSG_ERROR`.
const NLMSG_ERROR: u16 = 2;
/// `NLM_F_REQUEST`: one exact lookup, not a dump.
const NLM_F_REQUEST: u16 = 1;
/// `IPPROTO_TCP`.
const TCP: u8 = 6;
/// `TCP_ESTABLISHED`, as `inet_diag_msg.idiag_state` says it.
const ESTABLISHED: u8 = 1;
/// Where `idiag_uid` is in an answer: the 16-byte `nlmsghdr`, then `inet_diag_msg`'s family,
/// state, timer and retrans (4), its socket id (48), expires, rqueue and wqueue (12).
const UID_AT: usize = 16 + 4 + 48 + 12;

/// The uid owning the client's end of the connection from `peer` to `local`, when the kernel
/// knows it as an established socket.
pub fn uid_of(peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    let fd = rustix::net::socket_with(
        AddressFamily::NETLINK,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        Some(netlink::SOCK_DIAG),
    )
    .ok()?;
    // The kernel answers at once; a bound on the wait all the same.
    rustix::net::sockopt::set_socket_timeout(
        &fd,
        rustix::net::sockopt::Timeout::Recv,
        Some(Duration::from_secs(1)),
    )
    .ok()?;
    rustix::net::send(&fd, &request(peer, local)?, SendFlags::empty()).ok()?;
    let mut answer = [0u8; 512];
    let (n, _) = rustix::net::recv(&fd, &mut answer, RecvFlags::empty()).ok()?;
    uid_in(&answer[..n.min(answer.len())])
}

/// The lookup of the socket whose local address is `peer` and remote address `local`.
fn request(peer: SocketAddr, local: SocketAddr) -> Option<Vec<u8>> {
    let family = match (peer.ip(), local.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => AddressFamily::INET,
        (IpAddr::V6(_), IpAddr::V6(_)) => AddressFamily::INET6,
        _ => return None,
    };
    let mut req = Vec::with_capacity(72);
    // nlmsghdr: length, type, flags, sequence, port id (host order).
    req.extend_from_slice(&72u32.to_ne_bytes());
    req.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    // inet_diag_req_v2: family, protocol, extensions, pad, states (every one).
    req.push(u8::try_from(family.as_raw()).ok()?);
    req.extend_from_slice(&[TCP, 0, 0]);
    req.extend_from_slice(&u32::MAX.to_ne_bytes());
    // inet_diag_sockid: ports and addresses in network order, interface, no cookie.
    req.extend_from_slice(&peer.port().to_be_bytes());
    req.extend_from_slice(&local.port().to_be_bytes());
    req.extend_from_slice(&address(peer.ip()));
    req.extend_from_slice(&address(local.ip()));
    req.extend_from_slice(&0u32.to_ne_bytes());
    req.extend_from_slice(&u32::MAX.to_ne_bytes());
    req.extend_from_slice(&u32::MAX.to_ne_bytes());
    debug_assert_eq!(req.len(), 72);
    Some(req)
}

/// An address as `inet_diag_sockid` holds it: 16 bytes, an IPv4 one in the first four.
fn address(ip: IpAddr) -> [u8; 16] {
    let mut out = [0u8; 16];
    match ip {
        IpAddr::V4(v4) => out[..4].copy_from_slice(&v4.octets()),
        IpAddr::V6(v6) => out = v6.octets(),
    }
    out
}

/// The uid of an answer that names an established socket; none for an error (no such socket)
/// or anything shorter than an answer.
fn uid_in(answer: &[u8]) -> Option<u32> {
    let kind = u16::from_ne_bytes(answer.get(4..6)?.try_into().ok()?);
    if kind == NLMSG_ERROR || kind != SOCK_DIAG_BY_FAMILY || *answer.get(17)? != ESTABLISHED {
        return None;
    }
    Some(u32::from_ne_bytes(
        answer.get(UID_AT..UID_AT + 4)?.try_into().ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_names_the_clients_socket_exactly() {
        let peer: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:5005".parse().unwrap();
        let req = request(peer, local).unwrap();
        assert_eq!(req.len(), 72);
        assert_eq!(&req[16..18], &[AddressFamily::INET.as_raw() as u8, TCP]);
        assert_eq!(
            &req[24..26],
            &40000u16.to_be_bytes(),
            "source port: the client's"
        );
        assert_eq!(&req[26..28], &5005u16.to_be_bytes());
        assert_eq!(&req[28..32], &[127, 0, 0, 1]);
        assert_eq!(&req[64..72], &[0xff; 8], "no cookie: looked up by address");
        let mixed: SocketAddr = "[::1]:5005".parse().unwrap();
        assert!(request(peer, mixed).is_none());
    }

    #[test]
    fn errors_and_short_answers_name_nobody() {
        let mut error = vec![0u8; 36];
        error[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        assert_eq!(uid_in(&error), None);
        let mut answer = vec![0u8; UID_AT + 4];
        answer[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        answer[17] = ESTABLISHED;
        answer[UID_AT..].copy_from_slice(&1000u32.to_ne_bytes());
        assert_eq!(uid_in(&answer), Some(1000));
        answer[17] = 6; // TIME_WAIT
        assert_eq!(uid_in(&answer), None);
        assert_eq!(uid_in(&answer[..UID_AT]), None);
    }

    /// Real connections on this machine, one after another as a consumer opens them: the
    /// kernel names this process's uid every time (the socket table missed a third of them).
    #[test]
    fn real_loopback_connections_name_their_owner_every_time() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let me = rustix::process::geteuid().as_raw();
        for _ in 0..200 {
            let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (_server, peer) = listener.accept().unwrap();
            assert_eq!(peer, client.local_addr().unwrap());
            assert_eq!(uid_of(peer, listener.local_addr().unwrap()), Some(me));
        }
        let v6 = std::net::TcpListener::bind("[::1]:0");
        if let Ok(v6) = v6 {
            let _client = std::net::TcpStream::connect(v6.local_addr().unwrap()).unwrap();
            let (_server, peer) = v6.accept().unwrap();
            assert_eq!(uid_of(peer, v6.local_addr().unwrap()), Some(me));
        }
    }
}
