//! Built-in chat templates: a model file without one gets its family's conventional template
//! (logged), rendered as that family's own template renders.

use tboost_testkit::golden::model_file;

use tboost_engine::model::Model;
use tboost_engine::tokenizer::{ChatTemplate, Family, Message};

fn msgs() -> Vec<Message> {
    vec![
        Message::new("system", "Be brief."),
        Message::new("user", "Hi"),
        Message::new("assistant", "Hello."),
        Message::new("user", "Bye"),
    ]
}

#[test]
fn a_file_without_a_template_gets_its_familys() {
    // llama-2-tiny-random: a Llama GGUF with Llama 2's vocabulary and no template.
    let m = Model::load(&model_file("llama-2-tiny-random.gguf")).unwrap();
    let t = m.chat_template.as_ref().expect("a built-in template");
    assert_eq!(t.origin(), "built-in Llama 2 chat template for llama");
    assert_eq!(t.render(&msgs(), true).unwrap(), "<s>[INST] Be brief.\n\nHi [/INST] Hello.</s>[INST] Bye [/INST]");
    // The text tokenizes with Llama 2's control tokens.
    let ids = m.tokenizer.as_ref().unwrap().encode(&t.render(&msgs(), true).unwrap(), false).unwrap();
    assert_eq!(ids[0], 1, "BOS from the template");

    let tok = m.tokenizer.as_ref().unwrap();
    let render = |f| ChatTemplate::builtin(f, tok, "test").render(&msgs(), true).unwrap();
    assert_eq!(
        render(Family::ChatMl),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n\
         <|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        render(Family::Gemma),
        "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n\
         <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    );
    assert_eq!(
        render(Family::Phi3),
        "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello.<|end|>\n<|user|>\nBye<|end|>\n<|assistant|>\n"
    );
    assert_eq!(render(Family::Mistral), render(Family::Llama));
    // A role the [INST] format has no place for is an error naming it, not dropped text.
    let err =
        ChatTemplate::builtin(Family::Mistral, tok, "test").render(&[Message::new("tool", "42")], true).unwrap_err();
    assert!(err.to_string().contains("not tool"), "{err}");
}
