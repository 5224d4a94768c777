//! `omnistage shape --admin URL --activity PATH`: the shaping group's link to a running
//! omnistage, through the admin client (`POST /api/v1/activities/{path}:attach` and `:report`;
//! see `omnistage_admin`'s `shaped` module for the server's side, `omnistage_shape::link` for
//! the reporter).

use omnistage_admin::client::{Client, Reply};
use omnistage_admin::model::{Shaped, ShapedAttach, ShapedReport};
use omnistage_admin::TOKEN_ENV;
use omnistage_shape::launch::ShapeArgs;
use omnistage_shape::link::{Link, LinkError, Rates};
use omnistage_shape::meter::IO_KINDS;

pub struct AdminLink {
    client: Client,
    /// `/api/v1/activities{activity}`.
    base: String,
}

impl AdminLink {
    /// The link `a` asks for, if any.
    pub fn of(a: &ShapeArgs) -> Result<Option<Box<dyn Link>>, String> {
        let (Some(url), Some(activity)) = (&a.admin, &a.activity) else {
            return Ok(None);
        };
        omnistage::activity::parse_path(activity).map_err(|e| format!("--activity: {e}"))?;
        let token = a
            .token
            .clone()
            .or_else(|| std::env::var(TOKEN_ENV).ok().filter(|t| !t.is_empty()));
        Ok(Some(Box::new(AdminLink {
            client: Client::new(url, token)?,
            base: format!("/api/v1/activities{activity}"),
        })))
    }

    fn post(&self, verb: &str, body: &impl serde::Serialize) -> Result<Rates, LinkError> {
        let body = serde_json::to_vec(body).expect("serializes");
        let r = self
            .client
            .request("POST", &format!("{}:{verb}", self.base), Some(&body))
            .map_err(LinkError::Failed)?;
        rates_of(&r, verb)
    }
}

fn rates_of(r: &Reply, verb: &str) -> Result<Rates, LinkError> {
    match r.status {
        200 | 201 => {
            let s: Shaped = serde_json::from_slice(&r.body)
                .map_err(|e| LinkError::Failed(format!("{verb}: the answer: {e}")))?;
            Ok(Rates {
                net: s.cap_net,
                disk: s.cap_disk,
            })
        }
        404 if verb == "report" => Err(LinkError::Detached(r.error_message())),
        s => Err(LinkError::Failed(format!(
            "{verb}: {s} {}",
            r.error_message()
        ))),
    }
}

impl Link for AdminLink {
    fn attach(&mut self, rates: Rates) -> Result<Rates, LinkError> {
        let num = |v: Option<u64>| v.map_or(serde_json::Value::Null, serde_json::Value::from);
        self.post(
            "attach",
            &ShapedAttach {
                cap_net: num(rates.net),
                cap_disk: num(rates.disk),
            },
        )
    }

    fn report(&mut self, bytes: [u64; IO_KINDS]) -> Result<Rates, LinkError> {
        self.post(
            "report",
            &ShapedReport {
                bytes_in: bytes[0],
                bytes_out: bytes[1],
                disk_read_bytes: bytes[2],
                disk_write_bytes: bytes[3],
            },
        )
    }
}

#[cfg(test)]
mod tests {
    /// The shaping library splits its reports at what the admin API accepts.
    #[test]
    fn a_report_part_is_what_the_admin_api_accepts() {
        assert_eq!(
            omnistage_shape::link::REPORT_BYTES_MAX,
            omnistage_admin::model::SHAPED_REPORT_BYTES_MAX
        );
    }
}
