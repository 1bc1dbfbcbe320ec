//! Feed-forward blocks: gated (`down(act(gate(x)) * up(x))`, Llama/Bamba) and plain
//! (`down(act(up(x)))`, NemotronH's relu² MLP and experts).

use super::{Linear, Loader};
use crate::backend::{Activation, LayerOps};
use crate::model::ModelError;

pub struct Mlp<B: LayerOps> {
    pub gate: Option<Linear<B>>,
    pub up: Linear<B>,
    pub down: Linear<B>,
    pub act: Activation,
}

impl<B: LayerOps> Mlp<B> {
    pub fn load_gated(
        l: &Loader<'_, B>,
        prefix: &str,
        hidden: usize,
        inter: usize,
        bias: bool,
        act: Activation,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            gate: Some(l.linear(&format!("{prefix}.gate_proj"), inter, hidden, bias)?),
            up: l.linear(&format!("{prefix}.up_proj"), inter, hidden, bias)?,
            down: l.linear(&format!("{prefix}.down_proj"), hidden, inter, bias)?,
            act,
        })
    }

    pub fn load_plain(
        l: &Loader<'_, B>,
        prefix: &str,
        hidden: usize,
        inter: usize,
        bias: bool,
        act: Activation,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            gate: None,
            up: l.linear(&format!("{prefix}.up_proj"), inter, hidden, bias)?,
            down: l.linear(&format!("{prefix}.down_proj"), hidden, inter, bias)?,
            act,
        })
    }

    pub fn forward(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor, ModelError> {
        let hidden = match &self.gate {
            Some(gate) => b.gated_linear(
                x,
                (&gate.w, gate.b.as_ref()),
                (&self.up.w, self.up.b.as_ref()),
                self.act,
            )?,
            None => b.linear_activated(x, &self.up.w, self.up.b.as_ref(), self.act)?,
        };
        self.down.forward(b, &hidden)
    }
}
