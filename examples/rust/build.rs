//! Finds libkvtier by running the `pkg-config` command (no crates), links it
//! with an rpath so that `cargo test` runs against the library pkg-config
//! named, and writes $OUT_DIR/layout.rs from a C program (layout.c) compiled
//! with the same flags: the layout of every public struct, which
//! tests/layout.rs compares with src/sys.rs.
use std::env;
use std::fs;
use std::path::PathBuf;
use std::process::Command;

fn fail(msg: &str) -> ! {
    panic!(
        "\n\nkvtier build: {msg}\n\
         Install libkvtier (`make install` in the libkvtier tree) or set PKG_CONFIG_PATH to \
         the directory holding kvtier.pc (e.g. PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig).\n\n"
    );
}

fn pkg_config(args: &[&str]) -> String {
    let prog = env::var("PKG_CONFIG").unwrap_or_else(|_| "pkg-config".to_string());
    // The child inherits PKG_CONFIG_PATH, PKG_CONFIG_SYSROOT_DIR, etc.
    let out = match Command::new(&prog).args(args).arg("kvtier").output() {
        Ok(o) => o,
        Err(e) => fail(&format!("cannot run `{prog}`: {e}")),
    };
    if !out.status.success() {
        fail(&format!(
            "`{prog} {} kvtier` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    String::from_utf8(out.stdout).unwrap_or_else(|_| fail("pkg-config printed non-UTF-8 output"))
}

fn main() {
    for v in ["PKG_CONFIG", "PKG_CONFIG_PATH", "PKG_CONFIG_LIBDIR", "PKG_CONFIG_SYSROOT_DIR", "CC"]
    {
        println!("cargo:rerun-if-env-changed={v}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=layout.c");

    let flags = pkg_config(&["--cflags", "--libs"]);
    let mut cflags = Vec::new();
    let mut linked = false;
    for tok in flags.split_whitespace() {
        if let Some(dir) = tok.strip_prefix("-L") {
            println!("cargo:rustc-link-search=native={dir}");
            // Tests and examples find the library where pkg-config said it is.
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
            println!("cargo:libdir={dir}");
        } else if let Some(lib) = tok.strip_prefix("-l") {
            println!("cargo:rustc-link-lib={lib}");
            linked |= lib == "kvtier";
        } else if tok.starts_with("-I") || tok.starts_with("-D") {
            if let Some(dir) = tok.strip_prefix("-I") {
                println!("cargo:include={dir}");
            }
            cflags.push(tok.to_string());
        }
    }
    if !linked {
        fail(&format!("pkg-config's flags do not name -lkvtier: {}", flags.trim()));
    }

    // The struct layouts as the C compiler sees them through the same headers.
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let cc = env::var("CC").ok().filter(|s| !s.trim().is_empty()).unwrap_or_else(|| "cc".into());
    let mut cc_words = cc.split_whitespace(); // CC may carry flags ("gcc -m64")
    let exe = out_dir.join("kvtier-layout");
    let mut cmd = Command::new(cc_words.next().unwrap());
    cmd.args(cc_words).arg("-std=c11").args(&cflags).arg("layout.c").arg("-o").arg(&exe);
    let st = cmd
        .status()
        .unwrap_or_else(|e| panic!("kvtier build: cannot run the C compiler `{cc}`: {e}"));
    if !st.success() {
        panic!("kvtier build: `{cmd:?}` failed ({st}); are the kvtier headers installed?");
    }
    let out = Command::new(&exe)
        .output()
        .unwrap_or_else(|e| panic!("kvtier build: cannot run {}: {e}", exe.display()));
    if !out.status.success() {
        panic!("kvtier build: {} failed ({})", exe.display(), out.status);
    }
    fs::write(out_dir.join("layout.rs"), &out.stdout).expect("write layout.rs");
}
