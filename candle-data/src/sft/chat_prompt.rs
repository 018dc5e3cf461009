//! The prompt of a chat with a model (`trainer sample --chat`): a user message, after an
//! optional system message, rendered with the model's chat template and its generation prompt,
//! and the token that ends the assistant's turn.

use super::{Message, Role, SftEncoder};
use crate::{Error, Result};

impl SftEncoder {
    /// `user` (after `system`, if given) rendered with the chat template and the generation
    /// prompt, as `apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`.
    pub fn chat_prompt(&self, system: Option<&str>, user: &str) -> Result<String> {
        let mut messages: Vec<Message> = system
            .map(|s| Message::new(Role::System, s))
            .into_iter()
            .collect();
        messages.push(Message::new(Role::User, user));
        self.render(&messages, true)
    }

    /// The token that ends an assistant turn in the chat template (`<|im_end|>`,
    /// `<|eot_id|>`, `<end_of_turn>`, ...): the first token the template writes after an
    /// assistant message's content, when it is a special token of the tokenizer; `None` if
    /// the template ends turns with ordinary text.
    pub fn end_of_turn(&self) -> Result<Option<u32>> {
        const MARK: &str = "END-OF-TURN-PROBE";
        let text = self.render(
            &[
                Message::new(Role::User, "?"),
                Message::new(Role::Assistant, MARK),
            ],
            false,
        )?;
        let Some(at) = text.rfind(MARK) else {
            return Err(Error::data(
                self.path(),
                "the chat template does not write the assistant's message as given",
            ));
        };
        let (ids, _) = self.tokenize(&text[at + MARK.len()..], false)?;
        let special = self.tokenizer().get_added_tokens_decoder();
        Ok(ids
            .first()
            .copied()
            .filter(|id| special.get(id).is_some_and(|t| t.special)))
    }
}
