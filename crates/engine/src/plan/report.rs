//! The plan for people (log lines, `tboost plan` text) and for programs (JSON).

use std::fmt::Write as _;

use super::{Decision, Placement, Plan};

impl Decision {
    /// `attention_prefill: flash_attention on cpu (head_dim=64)` or, for a fallback,
    /// `attention_prefill: fallback to standard attention on cpu (...)`.
    pub fn line(&self) -> String {
        let kernel = self.kernel.as_ref().map(|k| format!(" [{k}]")).unwrap_or_default();
        let mut s = if self.fallback {
            format!("{}: {}{kernel}", self.slot.name(), self.reason)
        } else {
            format!("{}: {} on {}{kernel} ({})", self.slot.name(), self.choice.name(), self.backend, self.reason)
        };
        match self.weights {
            super::WeightMode::Convert(to) => {
                let _ = write!(s, "; weights converted to {to} at upload");
            }
            super::WeightMode::Packed => {
                let _ = write!(s, "; weights repacked into {}'s panel layout at upload", self.backend);
            }
            super::WeightMode::Native => {}
        }
        if self.placement == Placement::Cpu {
            let _ = write!(s, "; {} bytes per token copied to and from the cpu", self.copy_bytes_per_token);
        }
        s
    }
}

impl Plan {
    /// Logs the device and one line per distinct decision with the layers it applies to:
    /// fallbacks as warnings, the rest as info.
    pub fn log(&self) {
        let d = &self.device;
        log::info!(
            target: "tboost::plan",
            "plan: backend {} ({}{}), activations {}, KV cache {} in blocks of {}",
            d.backend,
            d.device,
            d.runtime_version.as_ref().map(|v| format!(", runtime {v}")).unwrap_or_default(),
            self.act_dtype,
            self.kv_dtype,
            self.block_size
        );
        if let Some(tp) = &self.tp {
            log::info!(target: "tboost::plan", "{}", tp.line());
        }
        if let Some(why) = &self.kv_dtype_reason {
            log::warn!(target: "tboost::plan", "plan: {why}");
        }
        for (fallback, line) in self.grouped() {
            if fallback {
                log::warn!(target: "tboost::plan", "{line}");
            } else {
                log::info!(target: "tboost::plan", "{line}");
            }
        }
    }

    /// `layers 0-21: attention_prefill: flash_attention on cpu (head_dim=64)` style lines,
    /// model-level slots as `model: ...`.
    pub fn summary_lines(&self) -> Vec<String> {
        self.grouped().into_iter().map(|(_, l)| l).collect()
    }

    fn grouped(&self) -> Vec<(bool, String)> {
        let mut out: Vec<(bool, String)> =
            self.model.iter().map(|d| (d.fallback, format!("model: {}", d.line()))).collect();
        let mut groups: Vec<(&Decision, String, Vec<usize>)> = Vec::new();
        for l in &self.layers {
            for d in &l.decisions {
                let line = d.line();
                match groups.iter_mut().find(|(_, g, _)| *g == line) {
                    Some((_, _, ls)) => ls.push(l.layer),
                    None => groups.push((d, line, vec![l.layer])),
                }
            }
        }
        out.extend(groups.into_iter().map(|(d, line, ls)| (d.fallback, format!("layers {}: {line}", ranges(&ls)))));
        out
    }

    /// Human-readable table for `tboost plan`.
    pub fn to_text(&self) -> String {
        let d = &self.device;
        let mut s = format!("backend: {} ({})\n", d.backend, d.device);
        if let Some(v) = &d.runtime_version {
            let _ = writeln!(s, "runtime: {v}");
        }
        let _ = writeln!(s, "architecture: {}", self.architecture);
        let _ = writeln!(
            s,
            "activations: {}, kv cache: {} (blocks of {}), precision: {}",
            self.act_dtype,
            self.kv_dtype,
            self.block_size,
            self.precision.name()
        );
        if let Some(why) = &self.kv_dtype_reason {
            let _ = writeln!(s, "kv cache fallback: {why}");
        }
        if !self.disabled.is_empty() {
            let _ = writeln!(s, "disabled: {}", self.disabled.join(", "));
        }
        if let Some(t) = self.tiling_line() {
            let _ = writeln!(s, "tiling: {t}");
        }
        if self.copy_bytes_per_token > 0 {
            let _ = writeln!(s, "copied between backends: {} bytes per token", self.copy_bytes_per_token);
        }
        let row = |s: &mut String, d: &Decision| {
            let mark = if d.fallback { "*" } else { " " };
            let kernel = d.kernel.as_deref().map(|k| format!(" [{k}]")).unwrap_or_default();
            let weights = match d.weights {
                super::WeightMode::Convert(to) => format!("; weights converted to {to} at upload"),
                super::WeightMode::Packed => format!("; weights repacked into {}'s panel layout at upload", d.backend),
                super::WeightMode::Native => String::new(),
            };
            let _ = writeln!(
                s,
                " {mark}{:<18} {:<28} {:<6} {}{kernel}{weights}",
                d.slot.name(),
                d.choice.name(),
                d.backend,
                d.reason
            );
        };
        let _ = writeln!(s, "model:");
        for d in &self.model {
            row(&mut s, d);
        }
        for l in &self.layers {
            let _ = writeln!(s, "layer {}:", l.layer);
            for d in &l.decisions {
                row(&mut s, d);
            }
        }
        let _ = writeln!(s, "(* = fallback)");
        s
    }

    /// The tunables set away from their defaults, `attention.tile_kv=128 matmul.panel_rows=96`
    /// (MoE ones marked unused when no slot runs the grouped MoE); `None` when all are defaults.
    pub fn tiling_line(&self) -> Option<String> {
        use tboost_ops::Tiling;
        let mut words = Vec::new();
        if self.attention_tile_kv != tboost_ops::DEFAULT_TILE_KV {
            words.push(format!("attention.tile_kv={}", self.attention_tile_kv));
        }
        words.extend(self.matmul_tiling.set_values().into_iter().map(|(n, v)| format!("matmul.{n}={v}")));
        let grouped = self.decisions().any(|d| d.choice == super::Choice::MoeGrouped);
        for (n, v) in self.moe_tiling.set_values() {
            words.push(format!("moe.{n}={v}{}", if grouped { "" } else { " (unused: no moe_grouped slot)" }));
        }
        (!words.is_empty()).then(|| words.join(" "))
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

/// `[0,1,2,5]` → `"0-2,5"`.
fn ranges(v: &[usize]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        out.push(if i == j { v[i].to_string() } else { format!("{}-{}", v[i], v[j]) });
        i = j + 1;
    }
    out.join(",")
}
