//! An HTTP tool made from an OpenAPI operation, as data: the flat argument object the model
//! fills, and where each argument goes in the request (a path segment, the query, a header,
//! the JSON body). Read from the document when the catalog is loaded (`config::openapi`);
//! the request is built from it when the call is sent (`tools::request`). Pure data.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// How an operation's request is made from a call's arguments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiCall {
    /// The operation's `operationId` (or `METHOD path` when it has none), for messages.
    pub operation: String,
    /// The path template under the tool's `url` (`/customers/{customer_id}`).
    pub path: String,
    /// The JSON Schema of the arguments the model fills: one object of the parameters and
    /// the body's properties (see `docs/catalog.md`).
    pub schema: Value,
    /// The arguments that are parameters, and where each one goes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub params: Vec<ApiParam>,
    #[serde(default, skip_serializing_if = "ApiBody::is_none")]
    pub body: ApiBody,
    /// Headers whose values come from the daemon's environment, never from the model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub auth: Vec<ApiAuth>,
}

/// Where a parameter goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Place {
    Path,
    Query,
    Header,
}

/// One parameter: the argument that fills it, its name in the request, and its place.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiParam {
    pub arg: String,
    pub name: String,
    pub place: Place,
}

/// The JSON request body: none, the named arguments as the fields of one object, or one
/// argument that is the whole body (a body that is not an object, or whose fields would
/// clash with a parameter's name).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiBody {
    #[default]
    None,
    Fields(Vec<String>),
    Whole(String),
}

impl ApiBody {
    fn is_none(&self) -> bool {
        matches!(self, ApiBody::None)
    }
}

/// A header set from an environment variable of the daemon: `Authorization: Bearer VALUE`
/// when `bearer`, else `HEADER: VALUE` (an API key).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiAuth {
    pub header: String,
    pub env: String,
    #[serde(default)]
    pub bearer: bool,
}
