//! The codec of the generated `credgate.v1` services and clients: prost's, except that a message
//! that does not decode is INVALID_ARGUMENT (the sender's error) rather than the INTERNAL that
//! tonic's prost codec answers. This is where that error is known, so the status is decided
//! here and nowhere else.

use tonic::codec::{BufferSettings, DecodeBuf};
use tonic::Status;
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// Used by the generated code (`codec_path` in `build.rs`).
#[derive(Debug, Clone, Default)]
pub struct Codec<T, U>(ProstCodec<T, U>);

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = Decoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        Decoder(self.0.decoder())
    }
}

/// prost's decoder, with a decode failure as INVALID_ARGUMENT.
#[derive(Debug, Clone)]
pub struct Decoder<U>(ProstDecoder<U>);

impl<U: prost::Message + Default> tonic::codec::Decoder for Decoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(|s| {
            Status::invalid_argument(format!("the message does not decode: {}", s.message()))
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}
