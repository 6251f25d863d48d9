//! A Python interpreter's command line, read as CPython reads it (`Modules/main.c`,
//! `Python/getopt.c`): short options grouped (`-uB`), an option's value attached (`-cCODE`,
//! `-Wdefault`) or in the next argument (`-c CODE`), `--` ending the options, and the first
//! argument that is not an option being the script (everything after it is the script's own).
//! What an agent's allow-lists see of a job's `python3 ...` command comes from here: inline code
//! (`-c` in every form), a program read from standard input (`-`), and a module (`-m`), whose
//! name the operator must have allowed.

/// What a Python command line runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PyMain {
    /// A script file: its index in the command (`command[i]`) and the path as given.
    Script(usize, String),
    /// `-m MODULE`: the index of the module's name and the name.
    Module(usize, String),
    /// `-c CODE` (attached or not, grouped or not): the index of the argument holding `c`.
    Inline(usize),
    /// `-` (or nothing at all): the program comes from standard input.
    Stdin(usize),
}

/// A Python command line, parsed: what it runs and the interpreter options before it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PyCommand {
    pub main: PyMain,
    /// Each interpreter option with its value (`('W', Some("error"))`, `('u', None)`), and the
    /// index of the argument it came from.
    pub options: Vec<(usize, char, Option<String>)>,
}

/// Short options that take a value (CPython's `-c`, `-m`, `-W`, `-X`).
const WITH_VALUE: &[char] = &['c', 'm', 'W', 'X'];
/// Short options without a value that CPython 3.8–3.14 knows.
const FLAGS: &[char] = &[
    'b', 'B', 'd', 'E', 'h', '?', 'i', 'I', 'O', 'P', 'q', 's', 'S', 'u', 'v', 'V', 'x', 'R',
];
/// Long options without a value.
const LONG_FLAGS: &[&str] = &[
    "--help",
    "--version",
    "--help-env",
    "--help-xoptions",
    "--help-all",
];

/// Parses `args` (the command after the interpreter; indices in errors and results count the
/// interpreter as 0). An error names the argument's index and why.
pub fn parse(args: &[String]) -> Result<PyCommand, (usize, String)> {
    let mut options = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let at = i + 1;
        let a = args[i].as_str();
        if a == "--" {
            i += 1;
            break;
        }
        if a == "-" {
            return Ok(PyCommand {
                main: PyMain::Stdin(at),
                options,
            });
        }
        if let Some(long) = a.strip_prefix("--") {
            let (name, value) = match long.split_once('=') {
                Some((n, v)) => (format!("--{n}"), Some(v.to_string())),
                None => (a.to_string(), None),
            };
            if name == "--check-hash-based-pycs" {
                let v = match value {
                    Some(v) => v,
                    None => {
                        i += 1;
                        args.get(i)
                            .cloned()
                            .ok_or((at, format!("{a} needs a value")))?
                    }
                };
                options.push((at, '-', Some(v)));
            } else if LONG_FLAGS.contains(&name.as_str()) && value.is_none() {
                options.push((at, '-', None));
            } else {
                return Err((at, format!("{a:?} is not an option CPython knows")));
            }
            i += 1;
            continue;
        }
        let Some(group) = a.strip_prefix('-') else {
            break; // the script
        };
        let chars: Vec<char> = group.chars().collect();
        let mut k = 0;
        while k < chars.len() {
            let c = chars[k];
            if WITH_VALUE.contains(&c) {
                let rest: String = chars[k + 1..].iter().collect();
                let value = if !rest.is_empty() {
                    rest
                } else {
                    i += 1;
                    args.get(i)
                        .cloned()
                        .ok_or((at, format!("-{c} needs a value")))?
                };
                match c {
                    'c' => {
                        return Ok(PyCommand {
                            main: PyMain::Inline(at),
                            options,
                        })
                    }
                    'm' => {
                        let index = if chars.len() > k + 1 { at } else { i + 1 };
                        return Ok(PyCommand {
                            main: PyMain::Module(index, value),
                            options,
                        });
                    }
                    _ => options.push((at, c, Some(value))),
                }
                break;
            }
            if !FLAGS.contains(&c) {
                return Err((
                    at,
                    format!("-{c} (in {a:?}) is not an option CPython knows"),
                ));
            }
            options.push((at, c, None));
            k += 1;
        }
        i += 1;
    }
    match args.get(i) {
        Some(s) => Ok(PyCommand {
            main: PyMain::Script(i + 1, s.clone()),
            options,
        }),
        None => Ok(PyCommand {
            main: PyMain::Stdin(args.len()),
            options,
        }),
    }
}

/// Whether `module` is allowed by `allowed` (`"pkg.mod"` exactly, `"pkg.*"` for `pkg` and
/// everything under it, `"*"` for any).
pub fn module_allowed(allowed: &[String], module: &str) -> bool {
    allowed.iter().any(|a| {
        a == "*"
            || a == module
            || a.strip_suffix(".*").is_some_and(|p| {
                module == p || module.strip_prefix(p).is_some_and(|r| r.starts_with('.'))
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<PyCommand, (usize, String)> {
        parse(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }
    fn main_of(args: &[&str]) -> PyMain {
        p(args).unwrap().main
    }

    /// Every way CPython takes inline code is found, attached, grouped or separate.
    #[test]
    fn inline_code_in_every_form() {
        for args in [
            &["-c", "x"][..],
            &["-cimport os"],
            &["-Ic", "x"],
            &["-uBc", "x"],
            &["-Icx"],
            &["-u", "-c", "x"],
            &["-W", "error", "-c", "x"],
            &["-Werror", "-Sc", "x"],
            &["-X", "dev", "-c", "x"],
        ] {
            assert!(
                matches!(main_of(args), PyMain::Inline(_)),
                "{args:?}: {:?}",
                p(args)
            );
        }
        // -c's index is the argument holding it
        assert_eq!(main_of(&["-u", "-Ic", "x"]), PyMain::Inline(2));
    }

    #[test]
    fn scripts_modules_and_stdin() {
        assert_eq!(
            main_of(&["t.py", "-c", "x"]),
            PyMain::Script(1, "t.py".into())
        );
        assert_eq!(main_of(&["-u", "t.py"]), PyMain::Script(2, "t.py".into()));
        assert_eq!(
            main_of(&["-W", "ignore", "/s/t.py"]),
            PyMain::Script(3, "/s/t.py".into())
        );
        assert_eq!(main_of(&["--", "-c"]), PyMain::Script(2, "-c".into()));
        assert_eq!(
            main_of(&["-m", "timeit", "x"]),
            PyMain::Module(2, "timeit".into())
        );
        assert_eq!(main_of(&["-mtimeit"]), PyMain::Module(1, "timeit".into()));
        assert_eq!(
            main_of(&["-Im", "timeit"]),
            PyMain::Module(2, "timeit".into())
        );
        assert_eq!(main_of(&["-"]), PyMain::Stdin(1));
        assert_eq!(main_of(&["-u"]), PyMain::Stdin(1));
        assert_eq!(main_of(&[]), PyMain::Stdin(0));
        assert!(p(&["-Z", "t.py"]).is_err());
        assert!(p(&["--bogus", "t.py"]).is_err());
        assert!(p(&["-W"]).is_err());
        let opts = p(&["-uWerror", "--check-hash-based-pycs", "never", "t.py"]).unwrap();
        assert_eq!(opts.main, PyMain::Script(4, "t.py".into()));
        assert_eq!(
            opts.options,
            vec![
                (1, 'u', None),
                (1, 'W', Some("error".into())),
                (2, '-', Some("never".into()))
            ]
        );
    }

    #[test]
    fn module_allow_list() {
        let a = vec!["torch.distributed.run".to_string(), "mypkg.*".to_string()];
        assert!(module_allowed(&a, "torch.distributed.run"));
        assert!(module_allowed(&a, "mypkg"));
        assert!(module_allowed(&a, "mypkg.train"));
        assert!(!module_allowed(&a, "mypkgx"));
        assert!(!module_allowed(&a, "timeit"));
        assert!(!module_allowed(&[], "timeit"));
        assert!(module_allowed(&["*".to_string()], "timeit"));
    }
}
