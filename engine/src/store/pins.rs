//! Pins: `pins/<name>` holds a key that `gc` keeps, with its ancestors.

use super::{Store, write_atomic};
use crate::diag::{InputError, Result, io_err};
use std::path::{Path, PathBuf};

impl Store {
    fn pin_path(&self, name: &str) -> Result<PathBuf> {
        if name.is_empty() || name.contains(['/', '\0']) || name.starts_with('.') {
            return Err(InputError::new(format!("`{name}` is not a valid pin name")).into());
        }
        Ok(self.root.join("pins").join(name))
    }

    /// Pin what `target` (a stage name or key prefix) resolves to under `name`; returns the key.
    pub fn pin(&self, name: &str, target: Option<&str>, manifest: Option<&Path>) -> Result<String> {
        let path = self.pin_path(name)?;
        let Some(target) = target else {
            return Err(InputError::new("pin needs a target: nemo-dag pin NAME STAGE|KEY").into());
        };
        let key = self.resolve_target(target, manifest)?;
        write_atomic(&path, format!("{key}\n").as_bytes(), true)
            .map_err(|e| io_err("cannot write pin", &path, e))?;
        Ok(key)
    }

    /// Remove the pin `name`.
    pub fn unpin(&self, name: &str) -> Result<()> {
        let path = self.pin_path(name)?;
        std::fs::remove_file(&path).map_err(|e| io_err("cannot remove pin", &path, e))
    }
}
