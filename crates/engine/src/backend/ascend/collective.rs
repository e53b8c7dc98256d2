//! The Ascend backend as a rank of an HCCL group: the tensor-parallel all-reduce and all-gather
//! as `HcclAllReduce` / `HcclAllGather` on the backend's own device buffers and stream, queued in
//! order with the ops (no host round trip). A rank that does not arrive within
//! `HCCL_EXEC_TIMEOUT` fails the next synchronize with HCCL's message naming it.

use ascend_sys::{Hccl, HcclComm, HcclDType, RootInfo};
use tboost_ops::{DType, Unsupported};

use super::supports::MC2;
use super::{acl_err, be_err, AscendBackend};
use crate::backend::{DeviceCollective, View, WeightId};
use crate::Result;

fn hccl_dtype(d: DType) -> Result<HcclDType> {
    Ok(match d {
        DType::F32 => HcclDType::F32,
        DType::F16 => HcclDType::F16,
        DType::BF16 => HcclDType::Bf16,
        DType::I32 => HcclDType::I32,
        DType::I8 => HcclDType::I8,
        other => return Err(be_err(format!("HCCL collectives: {other} buffers are not reduced on the device"))),
    })
}

impl AscendBackend {
    /// Makes this backend rank `comm.rank()` of an HCCL group (the communicator's device must be
    /// this backend's).
    pub fn set_hccl(&mut self, comm: HcclComm) {
        log::info!("ascend: device {} is HCCL rank {} of {}", self.dev.id(), comm.rank(), comm.size());
        self.hccl = Some(comm);
    }

    /// `HcclGetRootInfo` with this backend's device current (HCCL needs it on the root's thread).
    pub(super) fn make_root_info(&mut self) -> Result<Vec<u8>> {
        self.bind()?;
        let hccl = Hccl::load(&self.cann).map_err(|e| acl_err("loading libhccl.so", e))?;
        let root = hccl.root_info().map_err(|e| acl_err("HcclGetRootInfo", e))?;
        Ok(root.as_bytes().to_vec())
    }

    /// `HcclCommInitRootInfo` for rank `rank` of `world` on this backend's device, which must be
    /// current on the calling thread; the communicator is then this backend's.
    pub(super) fn join_root_info(&mut self, root: &[u8], world: usize, rank: usize) -> Result<()> {
        self.bind()?;
        let hccl = Hccl::load(&self.cann).map_err(|e| acl_err("loading libhccl.so", e))?;
        let root = RootInfo::from_bytes(root).map_err(|e| acl_err("the HCCL root info the leader sent", e))?;
        let (n, r) = (u32::try_from(world), u32::try_from(rank));
        let (Ok(n), Ok(r)) = (n, r) else {
            return Err(be_err(format!("HCCL group of {world} ranks: too many")));
        };
        let comm = hccl
            .init_rank(n, &root, r)
            .map_err(|e| acl_err(&format!("HcclCommInitRootInfo (rank {rank} of {world})"), e))?;
        self.set_hccl(comm);
        Ok(())
    }

    fn comm(&self) -> Result<&HcclComm> {
        self.hccl.as_ref().ok_or_else(|| be_err("no HCCL communicator attached"))
    }
}

impl DeviceCollective for AscendBackend {
    fn collective_name(&self) -> &'static str {
        "hccl"
    }

    fn all_reduce_sum(&mut self, v: View) -> Result<()> {
        self.bind()?;
        let dt = hccl_dtype(self.mem.dtype(v)?)?;
        let comm = self.comm()?;
        let (buf, at, _) = self.mem.bytes_of(v)?;
        let what = format!("HcclAllReduce (rank {}, {} values)", comm.rank(), v.len);
        comm.all_reduce_sum((buf, at), (buf, at), v.len, dt, self.ctx.stream()).map_err(|e| acl_err(&what, e))
    }

    fn all_gather(&mut self, src: View, dst: View) -> Result<()> {
        self.bind()?;
        let dt = hccl_dtype(self.mem.dtype(src)?)?;
        if self.mem.dtype(dst)? != self.mem.dtype(src)? {
            return Err(be_err("HcclAllGather: source and destination differ in dtype"));
        }
        let comm = self.comm()?;
        if dst.len != src.len * comm.size() as usize {
            return Err(be_err(format!(
                "HcclAllGather: {} values cannot hold {} ranks × {}",
                dst.len,
                comm.size(),
                src.len
            )));
        }
        let (sbuf, sat, _) = self.mem.bytes_of(src)?;
        let (dbuf, dat, _) = self.mem.bytes_of(dst)?;
        let what = format!("HcclAllGather (rank {}, {} values)", comm.rank(), src.len);
        comm.all_gather((sbuf, sat), (dbuf, dat), src.len, dt, self.ctx.stream()).map_err(|e| acl_err(&what, e))
    }

    fn fused_matmul_all_reduce(&self) -> std::result::Result<(), Unsupported> {
        let comm = self.comm().map_err(|e| Unsupported::new("hccl", "none", format!("a communicator ({e})")))?;
        self.caps.mc2(comm.size())?;
        comm.name().map(|_| ()).map_err(|e| Unsupported::new("symbol", "HcclGetCommName", format!("callable ({e})")))
    }

    /// MC2 for a weight held in the activation dtype (f16/bf16); a weight kept quantized or in
    /// another dtype is `Ok(false)` (the op takes no antiquant inputs).
    fn matmul_all_reduce(&mut self, x: View, m: usize, w: WeightId, out: View) -> Result<bool> {
        self.bind()?;
        let act = self.mem.dtype(x)?;
        let wt = self.mem.weight(w)?.clone();
        if wt.dtype != act || wt.scales.is_some() || self.mem.dtype(out)? != act {
            return Ok(false);
        }
        let (n, k) = (wt.rows, wt.cols);
        let group = self.comm()?.name().map_err(|e| acl_err("HcclGetCommName", e))?;
        let (ctx, mem) = (&mut self.ctx, &self.mem);
        let wv = mem.weight_tensor(&wt, &[n, k])?.transpose(0, 1).map_err(|e| acl_err(MC2, e))?;
        let (xt, ot) = (mem.tensor(x, &[m, k])?, mem.tensor(out, &[m, n])?);
        ascend_sys::aclnn::matmul_all_reduce(ctx, &xt, &wv, None, &group, &ot).map_err(|e| acl_err(MC2, e))?;
        Ok(true)
    }
}
