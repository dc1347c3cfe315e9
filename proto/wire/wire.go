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
		return nil, fmt.Errorf("%w: %v", ErrUndecodable, err)
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
