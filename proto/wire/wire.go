// Package wire is the hand-written leaf both planes share for config
// distribution: NATS names, the snapshot schema version, and encoding and
// verification of the messages in sluice.config.v1.
//
// Schema version history (bump SchemaVersion on any change a data plane
// must understand; keep the golden fixture of every old version decoding):
//
//	1 (2026-11-29): orgs, teams, users, members, customers, keys with old
//	  hashes; events with upserts, deletions and block changes; region
//	  events, snapshot pointers, ticks and heartbeats.
//	2 (2026-11-29): model groups and deployments (upstream, weight,
//	  capabilities, tags, prices, credential sealed by the key ring) in
//	  snapshots and as event upserts and deletions.
//
// Changes that need no version (old data planes read new snapshots and the
// reverse):
//
//	2026-12-01: Snapshot.budget_seeds (40, added with budgets under version
//	  2) removed and reserved: data planes ask for the ledger's current
//	  spend over request/reply instead (BudgetSeedSubject). A data plane of
//	  an older build reads a snapshot without seeds as "no spend", so
//	  upgrade the control plane first, then the data planes; until they
//	  are upgraded, an old data plane that loses its Redis starts budgets
//	  from zero.
//	2026-12-01: Org.traffic, Deployment.traffic and ModelGroup.traffic
//	  (traffic classes: classification rules, demotion, reserves, caps,
//	  engine priority, queue overrides) are ignored by data planes that do
//	  not enforce them yet and absent from older control planes' snapshots
//	  (every setting's zero value is "off").
//	2026-12-01: Heartbeat.rejecting (the refusal of the region's current
//	  snapshot in progress) is ignored by older control planes and absent
//	  from older data planes' heartbeats.
//	2026-12-01: Team.name and User.email (70), Snapshot.trusted_issuers
//	  (70) and the Event changes trusted_issuer/trusted_issuer_deleted
//	  (70, 71), for JWT credentials (docs/jwt.md). Older data planes read
//	  such snapshots without the issuers (they accept no JWTs) but cannot
//	  apply a trusted_issuer event (ErrUnknownChange): upgrade every data
//	  plane before the first issuer is created.
//	2026-12-01: ExplainSubject (request/reply, sluice.config.v1.Explain*):
//	  data planes of older builds do not subscribe, so the control plane
//	  answers explain requests for their regions with unavailable.
//	2026-12-01: ModelGroup.platform_wide and granted_org_ids (220, 221):
//	  a data plane serves an org only the groups that are platform-wide or
//	  granted to it (docs/tenancy.md). A data plane of an older build
//	  ignores both and serves every group to every org; a data plane of
//	  this build reading an older control plane's snapshot sees no group
//	  as platform-wide and serves none: upgrade the control plane (whose
//	  migration marks the existing groups platform-wide) first, then the
//	  data planes.
//	2026-12-01: ModelGroup.routing (160: strategy, session pin TTL,
//	  bounded-load factor; docs/routing.md "Strategies"). Older data
//	  planes ignore it and route by their built-in defaults; data planes
//	  read its absence (older control planes) as the defaults.
//	2026-12-01: ModelGroup.fallbacks and ModelGroup.resilience (180, 181),
//	  Key.fallbacks and Team.fallbacks (180): fallback model groups and
//	  per-group resilience settings (docs/resilience.md). Older data planes
//	  ignore them (no fallbacks: the request gets the primary's answer;
//	  the proxy flags apply); older control planes' snapshots lack them.
//	  Heartbeat.ejected (180) is ignored by older control planes and absent
//	  from older data planes' heartbeats.
//	2026-12-01: Heartbeat.admission_backlog (450: per traffic class, in
//	  flight, queued and shed; the fleet view and the console's Health &
//	  queues page) is ignored by older control planes and absent from
//	  older data planes' heartbeats (the fleet view shows no backlog).
//	2026-12-01: Snapshot.label_scopes (410) and the Event changes
//	  label_scope/label_scope_deleted (410, 411): project and tag scopes
//	  with their own limits (docs/limits.md "Project and tag scopes").
//	  Older data planes read such snapshots without them (the labels stay
//	  unlimited) but cannot apply a label_scope event (ErrUnknownChange):
//	  upgrade every data plane before the first project or tag scope is
//	  created. Budget seed requests of kinds project and tag need a
//	  control plane of this build.
//
// Usage messages (not snapshots) have their own encodings, named by
// UsageEncodingHeader:
//
//	(none) (2026-11-29): one sluice.usage.v1.UsageEvent per message.
//	batch.v1 (2026-12-01): one sluice.usage.v1.UsageBatch. Control planes
//	  read both; control planes before it terminate batches (they decode
//	  as events without a request id), so upgrade control planes first or
//	  run data planes with --usage-batch-events 1 meanwhile.
package wire

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"regexp"

	"google.golang.org/protobuf/proto"

	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// SchemaVersion is the snapshot schema this build writes and reads.
const SchemaVersion = 2

// NATS names. Every region has its own event stream, so a region's stream
// sequence is its region_seq and a data plane can start exactly after the
// snapshot it loaded.
const (
	// SnapshotBucket is the JetStream object store holding snapshot bodies.
	SnapshotBucket = "SLUICE_SNAPSHOTS"
	// PointerBucket is the JetStream KV bucket with one entry per region.
	PointerBucket = "SLUICE_CONFIG"
	// TickSubject carries the control plane's liveness ticks (core NATS).
	TickSubject = "sluice.control.tick"
	// HeartbeatSubjectPrefix + region + "." + instance carries heartbeats.
	HeartbeatSubjectPrefix = "sluice.fleet.heartbeat."
	// ResyncSubject is where a data plane that found a gap in its region's
	// stream asks for a fresh snapshot (core NATS; body: the region).
	ResyncSubject = "sluice.control.resync"
	// UsageStream is the JetStream stream of usage events (SPEC §9.2);
	// messages carry the request id as dedupe id.
	UsageStream = "SLUICE_USAGE"
	// UsageSubjectAll matches every region's usage subject.
	UsageSubjectAll = "sluice.usage.>"
	// HeartbeatSubjectAll subscribes to every heartbeat.
	HeartbeatSubjectAll = "sluice.fleet.heartbeat.>"
	// AlertStream is the JetStream stream of budget alerts
	// (sluice.usage.v1.BudgetAlert); messages carry the alert id as dedupe
	// id. The control plane records them (AlertService.ListAlerts).
	AlertStream = "SLUICE_ALERTS"
	// AlertSubjectAll matches every region's alert subject.
	AlertSubjectAll = "sluice.alerts.>"
	// BudgetSeedSubject is where a data plane asks for the ledger spend of
	// budget scopes whose Redis state is missing (core NATS request/reply;
	// body sluice.config.v1.BudgetSeedRequest, reply BudgetSeedReply).
	BudgetSeedSubject = "sluice.control.budget-seeds"
	// BudgetSeedQueue is the queue group of the control-plane replicas
	// answering BudgetSeedSubject: one of them answers each request.
	BudgetSeedQueue = "sluice-budget-seeds"
)

// AdmissionReleasePrefix + the model group's ReleaseToken is where a data
// plane announces that it released a deployment slot of the group (core
// NATS, body: the group name), so proxies with requests waiting for the
// group try again at once (docs/traffic.md, "Wake-up").
const AdmissionReleasePrefix = "sluice.admission.released."

// AdmissionReleaseSubject is the release subject of model group: a hash,
// since group names may hold characters a subject cannot.
func AdmissionReleaseSubject(group string) string {
	h := sha256.Sum256([]byte(group))
	return fmt.Sprintf("%s%x", AdmissionReleasePrefix, h[:8])
}

// ExplainSubject is where the control plane asks a data plane of region
// to explain a synthetic request (core NATS request/reply; body
// sluice.config.v1.ExplainWireRequest, reply ExplainWireReply; see
// docs/explain.md). The region's data planes subscribe in ExplainQueue, so
// one of them answers each request.
func ExplainSubject(region string) string { return "sluice.explain." + region }

// ExplainQueue is the queue group of a region's data planes on
// ExplainSubject.
const ExplainQueue = "sluice-explain"

// Usage message encodings. A message on a usage subject is either one
// sluice.usage.v1.UsageEvent (no UsageEncodingHeader: the only format of
// builds before 2026-12-01, and what a data plane publishes with
// --usage-batch-events 1) or, with the header set to UsageEncodingBatchV1,
// one sluice.usage.v1.UsageBatch. A control plane that finds another
// value leaves the message in the stream for a newer build (it is
// negatively acknowledged, never dropped). Upgrade control planes before
// data planes publish batches (docs/ledger.md, "Batches").
const (
	// UsageEncodingHeader names a usage message's encoding.
	UsageEncodingHeader = "Sluice-Usage-Encoding"
	// UsageEncodingBatchV1 marks a UsageBatch.
	UsageEncodingBatchV1 = "batch.v1"
	// UsageBatchMsgIDPrefix + batch id is a batch's JetStream message id
	// (a single event's is its request id).
	UsageBatchMsgIDPrefix = "b:"
)

// AlertSubject is where region's data planes publish budget alerts.
func AlertSubject(region string) string { return "sluice.alerts." + region }

var regionPattern = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)

// ValidRegion reports whether name is a valid region name.
func ValidRegion(name string) bool { return regionPattern.MatchString(name) }

// EventStream is the JetStream stream of region's events.
func EventStream(region string) string { return "SLUICE_EVENTS_" + region }

// EventSubject is the subject of region's events.
func EventSubject(region string) string { return "sluice.events." + region }

// UsageSubject is where region's data planes publish usage events.
func UsageSubject(region string) string { return "sluice.usage." + region }

// PointerKey is the KV key of region's snapshot pointer.
func PointerKey(region string) string { return "region." + region }

// SnapshotObject is the object-store name of a snapshot version.
func SnapshotObject(version uint64) string { return fmt.Sprintf("snapshot-%020d", version) }

// EventMsgID is the JetStream dedupe id of a region event.
func EventMsgID(region string, regionSeq uint64) string {
	return fmt.Sprintf("%s-%d", region, regionSeq)
}

// HeartbeatSubject is where instance of region publishes heartbeats.
func HeartbeatSubject(region, instance string) string {
	return HeartbeatSubjectPrefix + region + "." + instance
}

// Errors of DecodeSnapshot.
var (
	ErrDigest        = errors.New("snapshot digest does not match its pointer")
	ErrUndecodable   = errors.New("snapshot does not decode")
	ErrSchemaVersion = errors.New("snapshot schema version is not supported")
	ErrVersion       = errors.New("snapshot version does not match its pointer")
)

// Digest is the SHA-256 of an encoded snapshot.
func Digest(body []byte) []byte {
	d := sha256.Sum256(body)
	return d[:]
}

// EncodeSnapshot encodes s deterministically and returns the body and its
// digest.
func EncodeSnapshot(s *configv1.Snapshot) ([]byte, []byte, error) {
	body, err := proto.MarshalOptions{Deterministic: true}.Marshal(s)
	if err != nil {
		return nil, nil, fmt.Errorf("encode snapshot: %w", err)
	}
	return body, Digest(body), nil
}

// DecodeSnapshot verifies body against ptr (digest, version) and the
// schema version, then decodes it.
func DecodeSnapshot(body []byte, ptr *configv1.SnapshotPointer) (*configv1.Snapshot, error) {
	if ptr != nil && !equal(Digest(body), ptr.GetDigest()) {
		return nil, ErrDigest
	}
	s := &configv1.Snapshot{}
	if err := proto.Unmarshal(body, s); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUndecodable, err)
	}
	if s.GetSchemaVersion() == 0 || s.GetSchemaVersion() > SchemaVersion {
		return nil, fmt.Errorf("%w: got %d, this build reads up to %d", ErrSchemaVersion, s.GetSchemaVersion(), SchemaVersion)
	}
	if ptr != nil && s.GetVersion() != ptr.GetVersion() {
		return nil, fmt.Errorf("%w: pointer says %d, body says %d", ErrVersion, ptr.GetVersion(), s.GetVersion())
	}
	return s, nil
}

func equal(a, b []byte) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// Marshal encodes any config message.
func Marshal(m proto.Message) ([]byte, error) { return proto.Marshal(m) }

// Unmarshal decodes any config message.
func Unmarshal(b []byte, m proto.Message) error { return proto.Unmarshal(b, m) }
