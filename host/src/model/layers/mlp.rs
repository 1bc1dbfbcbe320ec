//! Feed-forward blocks: gated (`down(act(gate(x)) * up(x))`, Llama/Bamba) and plain
//! (`down(act(up(x)))`, NemotronH's relu² MLP and experts).

use super::{Linear, Loader};
use crate::backend::{Activation, Backend};
use crate::model::ModelError;

pub struct Mlp<B: Backend> {
    pub gate: Option<Linear<B>>,
    pub up: Linear<B>,
    pub down: Linear<B>,
    pub act: Activation,
}

impl<B: Backend> Mlp<B> {
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
            Some(gate) => {
                let [gate, up] = Linear::forward_shared(b, x, [gate, &self.up])?;
                b.gated_activation(&gate, &up, self.act)?
            }
            None => {
                let mut up = self.up.forward(b, x)?;
                b.activate(&mut up, self.act)?;
                up
            }
        };
        self.down.forward(b, &hidden)
    }
}
