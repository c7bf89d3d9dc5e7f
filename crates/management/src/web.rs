//! The management web page: one static HTML document calling `/api`.

use axum::Router;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

const INDEX: &str = include_str!("index.html");

async fn index() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], INDEX)
}

/// `/` and `/index.html`.
pub(crate) fn routes() -> Router {
    Router::new()
        .route("/", get(index))
        .route("/index.html", get(index))
}
