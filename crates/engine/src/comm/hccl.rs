//! The `hccl` communicator: N ranks, each on its own Ascend device, either threads of this
//! process (communicators from `HcclCommInitAll`) or, under `mpirun`, one process per device
//! (`HcclGetRootInfo` on rank 0, the root info carried to the others over MPI, and
//! `HcclCommInitRootInfo` on every rank, as MindIE hands the root info over its host channel).
//! The data plane (the all-reduce of activations, the logits all-gather) runs as HCCL collectives
//! on the devices' memory and streams (`backend::DeviceCollective`); the control plane (the
//! leader's step commands, barriers, the host fallbacks) stays on the host through a `local`
//! group or MPI, as vLLM keeps a CPU group beside NCCL. A timeout on either side breaks the
//! group: the engine must be re-created.

use std::time::Duration;

use super::{Communicator, LocalComm};
use crate::Result;

/// The host side of one rank of an `hccl` group: a `local` rank (threads) or an MPI rank (one
/// process per device), under the name `hccl`.
pub struct HcclControl<C: Communicator = LocalComm>(pub C);

impl<C: Communicator> Communicator for HcclControl<C> {
    fn name(&self) -> &'static str {
        "hccl"
    }
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world(&self) -> usize {
        self.0.world()
    }
    fn timeout(&self) -> Duration {
        self.0.timeout()
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        self.0.all_reduce_sum(buf)
    }
    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<()> {
        self.0.all_gather(local, out)
    }
    fn broadcast(&self, root: usize, bytes: &mut Vec<u8>) -> Result<()> {
        self.0.broadcast(root, bytes)
    }
    fn barrier(&self) -> Result<()> {
        self.0.barrier()
    }
    fn abandon(&self, why: &str) {
        self.0.abandon(why)
    }
    fn departed(&self) -> Option<(usize, String)> {
        self.0.departed()
    }
}

/// The devices of `world` ranks from the `devices` key (`ascend:0,1`, `0,1`, or empty: `first`
/// and the next `world - 1`).
pub fn parse_devices(spec: &str, world: usize, first: u32) -> Result<Vec<u32>> {
    let s = spec.trim();
    if s.is_empty() {
        return Ok((0..world as u32).map(|i| first + i).collect());
    }
    let list = s.strip_prefix("ascend:").unwrap_or(s);
    let devs = list
        .split(',')
        .map(|d| {
            d.trim().parse::<u32>().map_err(|_| {
                crate::Error::invalid("devices", format!("`{spec}`: `{d}` is not a device number (e.g. ascend:0,1)"))
            })
        })
        .collect::<Result<Vec<u32>>>()?;
    if devs.len() != world {
        return Err(crate::Error::invalid(
            "devices",
            format!("`{spec}` names {} devices for tp = {world} ranks", devs.len()),
        ));
    }
    if let Some(d) = devs.iter().enumerate().find_map(|(i, d)| devs[..i].contains(d).then_some(d)) {
        return Err(crate::Error::invalid("devices", format!("`{spec}` lists device {d} twice (one rank per device)")));
    }
    Ok(devs)
}

/// A group of `devices.len()` ranks: the host side of each and, from `HcclCommInitAll`, the
/// device communicator of each (rank i on `devices[i]`).
#[cfg(feature = "ascend")]
pub fn open_group(devices: &[u32], timeout: Duration) -> Result<(Vec<HcclControl>, Vec<ascend_sys::HcclComm>)> {
    let err = |e: ascend_sys::AclError| crate::Error::Backend { backend: "ascend".into(), msg: format!("hccl: {e}") };
    let cann = ascend_sys::Cann::load().map_err(err)?;
    let hccl = ascend_sys::Hccl::load(&cann).map_err(err)?;
    let ids: Vec<i32> = devices.iter().map(|&d| d as i32).collect();
    let comms = hccl.init_all(&ids).map_err(err)?;
    let ctl = super::LocalGroup::new(devices.len(), timeout).into_iter().map(HcclControl).collect();
    Ok((ctl, comms))
}

#[cfg(test)]
mod tests {
    use super::parse_devices;

    #[test]
    fn devices_default_to_the_backends_device_and_the_next_ones() {
        assert_eq!(parse_devices("", 3, 2).unwrap(), vec![2, 3, 4]);
        assert_eq!(parse_devices("ascend:4,1", 2, 0).unwrap(), vec![4, 1]);
        assert_eq!(parse_devices(" 0, 1 ", 2, 0).unwrap(), vec![0, 1]);
    }

    #[test]
    fn a_bad_device_list_is_refused_naming_the_problem() {
        let e = parse_devices("ascend:0,1", 4, 0).unwrap_err().to_string();
        assert!(e.contains("names 2 devices for tp = 4 ranks"), "{e}");
        let e = parse_devices("0,0", 2, 0).unwrap_err().to_string();
        assert!(e.contains("lists device 0 twice"), "{e}");
        let e = parse_devices("ascend:0,x", 2, 0).unwrap_err().to_string();
        assert!(e.contains("`x` is not a device number"), "{e}");
    }
}
