//! The native API's OpenAPI document, generated from the handlers' and types'
//! annotations (utoipa), served at `/api/v1/openapi.json`.

use axum::Json;
use utoipa::OpenApi;

use crate::{error, gallery_api, native};

#[derive(OpenApi)]
#[openapi(
    info(title = "brume native API", description = "brume's own image service API (see also /sdapi/v1 for A1111 clients and /v1 for OpenAI's images API)"),
    paths(
        native::models, native::samplers, native::capabilities,
        native::create_job, native::get_job, native::cancel_job, native::job_events, native::ws,
        gallery_api::list, gallery_api::get, gallery_api::image, gallery_api::thumb, gallery_api::patch,
        gallery_api::delete, gallery_api::purge, gallery_api::import,
    ),
    components(schemas(
        error::ErrorResponse, error::ErrorBody,
        native::ModelsResponse, native::ModelView, native::UnetView, native::SamplersResponse, native::SamplerView,
        native::Capabilities, native::JobRequest, native::Mode, native::PriorityName, native::LaneName, native::Accepted,
        native::JobView, native::JobResult, native::ResultImage, native::TimingsView, native::CancelResponse,
        native::EventView, native::WsIn, native::WsReply,
        gallery_api::GalleryItem, gallery_api::GalleryPage, gallery_api::GalleryDetail, gallery_api::GalleryPatch,
        gallery_api::PurgeResponse, gallery_api::ImportResponse,
    )),
    tags((name = "models"), (name = "jobs"), (name = "gallery")),
    modifiers(&Security),
)]
pub struct ApiDoc;

struct Security;

impl utoipa::Modify for Security {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = api.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        components.add_security_scheme(
            "basic",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Basic).build()),
        );
        api.info.version = env!("CARGO_PKG_VERSION").to_string();
    }
}

pub async fn document() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}
