//! Where a multi-token-prediction depth starts, on the device, as ops/model's `net.rs` computes
//! it on the CPU (after DeepSeek-V3's MTP modules, as Megatron-LM's `multi_token_prediction.py`
//! builds them): depth k joins the embedding of the tokens k further on with the previous
//! stack's hidden states, runs its own blocks, and is scored by the shared output head on the
//! labels k further on.
//!
//! ```text
//! forward:   e = embed(ids shifted left k)                             embedding_fwd_f32
//!            joined = [rms_norm(e, enorm); rms_norm(h, hnorm)]          rms_norm_fwd_f32, copy_columns_f32
//!            x = joined · eh_projᵀ               (h: the previous stack's output)   GEMM
//! backward:  eh_proj's gradient; djoined = dx · eh_proj                 GEMMs
//!            de = rms_norm_bwd(djoined[:, :D]) → the embedding's gradient
//!            dh = rms_norm_bwd(djoined[:, D:]) → added to the previous stack's output gradient
//! ```
//!
//! The depth's blocks, its final norm and its loss are the main stack's code on the depth's
//! own buffers ([`super::Stack`]); its loss weight per token is its shifted loss mask times
//! `mtp_loss_scale / depths` over the global batch's loss tokens, as on the CPU.

use super::launches::{Kernels, NT};
use super::{Activations, DeviceStep, Layout, Slot};
use kernels::launch::{Arg, Launcher};
use nemo_dag_op::RunError;

/// MTP depth `shift`'s own parameters (every depth's are depth 0's when `mtp_shared`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Join {
    /// k: how far on its ids and labels are.
    pub shift: usize,
    /// Which of the CPU model's `mtp` weights it uses.
    pub weights: usize,
    pub enorm: Slot,
    pub hnorm: Slot,
    /// `(hidden, 2·hidden)`.
    pub eh_proj: Slot,
    /// Its cross-entropy's weight in the loss: `mtp_loss_scale / depths`.
    pub loss_scale: f64,
}

/// What a depth's join keeps for the backward, for `rows` tokens: the embedded shifted ids,
/// the joined normed halves (`rows × 2·hidden`), and both norms' 1/rms (`2 × rows`).
pub(super) struct JoinActs<B> {
    embedded: B,
    joined: B,
    rstd: B,
}

/// The joins' scratch: a norm's output before it is placed in its half, the gradient of the
/// joined halves, and the gradient a depth sends back to the previous stack's output.
pub(super) struct JoinScratch<B> {
    normed: B,
    djoined: B,
    pub carry: B,
}

impl<B> JoinActs<B> {
    pub fn allocate(
        floats: &impl Fn(usize) -> Result<B, RunError>,
        rows: usize,
        hidden: usize,
    ) -> Result<JoinActs<B>, RunError> {
        Ok(JoinActs {
            embedded: floats(rows * hidden)?,
            joined: floats(rows * 2 * hidden)?,
            rstd: floats(2 * rows)?,
        })
    }
}

impl<B> JoinScratch<B> {
    /// `None` when the model has no MTP depth.
    pub fn allocate(
        floats: &impl Fn(usize) -> Result<B, RunError>,
        depths: usize,
        rows: usize,
        hidden: usize,
    ) -> Result<Option<JoinScratch<B>>, RunError> {
        if depths == 0 {
            return Ok(None);
        }
        Ok(Some(JoinScratch {
            normed: floats(rows * hidden)?,
            djoined: floats(rows * 2 * hidden)?,
            carry: floats(rows * hidden)?,
        }))
    }
}

fn at<B>(buffer: &B) -> Arg<'_, B> {
    Arg::Ptr(buffer, 0)
}

impl<L: Launcher> Kernels<'_, L> {
    /// The input `x` of depth `j` from its shifted `ids` and the previous stack's output `h`,
    /// on the weights `w` laid out as `l`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn join(
        &self,
        l: &Layout,
        w: &L::Buffer,
        j: &Join,
        a: &JoinActs<L::Buffer>,
        s: &JoinScratch<L::Buffer>,
        ids: &L::Buffer,
        (h, x): (Arg<'_, L::Buffer>, Arg<'_, L::Buffer>),
    ) -> Result<(), RunError> {
        let d = l.hidden;
        let rstd = |half: usize| Arg::Ptr(&a.rstd, half * self.rows * 4);
        self.embedding(l.embedding.at(w), ids, at(&a.embedded), l.vocab, d)?;
        for (half, (input, norm)) in [(at(&a.embedded), j.enorm), (h, j.hnorm)]
            .into_iter()
            .enumerate()
        {
            self.rms_norm(
                input,
                norm.at(w),
                at(&s.normed),
                rstd(half),
                d,
                l.eps,
                false,
            )?;
            self.columns((at(&a.joined), 2 * d, half * d), (at(&s.normed), d, 0), d)?;
        }
        self.gemm(
            at(&a.joined),
            j.eh_proj.at(w),
            x,
            (self.rows, d, 2 * d),
            NT,
            0.0,
        )
    }

    /// The backward of [`Kernels::join`] from `dx`, the gradient of its output: eh_proj's,
    /// the norms' and the embedding's gradients added into the step's, and the gradient of
    /// the previous stack's output `h` written to [`JoinScratch::carry`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn join_backward(
        &self,
        step: &DeviceStep<'_, L>,
        j: &Join,
        a: &JoinActs<L::Buffer>,
        s: &JoinScratch<L::Buffer>,
        acts: &Activations<L::Buffer>,
        ids: &L::Buffer,
        (h, dx): (Arg<'_, L::Buffer>, Arg<'_, L::Buffer>),
    ) -> Result<(), RunError> {
        let (l, g) = (&step.layout, &step.grads);
        let d = l.hidden;
        let rstd = |half: usize| Arg::Ptr(&a.rstd, half * self.rows * 4);
        let eh_proj = j.eh_proj.with_grad((&step.weights, g));
        let (joined, djoined) = (at(&a.joined), at(&s.djoined));
        self.linear_backward(dx, joined, eh_proj, djoined, (self.rows, d, 2 * d), 0.0)?;
        let half = |i: usize| self.columns((at(&s.normed), d, 0), (djoined, 2 * d, i * d), d);

        let de = at(&acts.dnorm_in);
        half(0)?;
        self.rms_norm_backward(
            at(&a.embedded),
            j.enorm,
            rstd(0),
            at(&s.normed),
            de,
            acts,
            step,
        )?;
        self.embedding_backward(de, ids, acts, l.vocab, d)?;
        self.add(l.embedding.at(g), at(&acts.dtable), l.vocab * d)?;

        half(1)?;
        self.rms_norm_backward(h, j.hnorm, rstd(1), at(&s.normed), at(&s.carry), acts, step)
    }
}
