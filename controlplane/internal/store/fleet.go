package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/sluicegw/sluice/controlplane/internal/store/dbsqlc"
	"github.com/sluicegw/sluice/proto/wire"
)

// HeartbeatInterval is how often a data plane publishes its heartbeat.
const HeartbeatInterval = 5 * time.Second

// DataPlaneLostAfter is how long the fleet view waits for a heartbeat
// before it reports an instance as lost: three missed heartbeats, so one
// late or dropped message does not flap the view.
const DataPlaneLostAfter = 3 * HeartbeatInterval

// DataPlane is one data-plane instance as its latest heartbeat reported
// it.
type DataPlane struct {
	InstanceID     string
	Region         string
	AppliedVersion uint64 // config version the instance runs
	EventsSeq      uint64 // last outbox seq applied
	RegionSeq      uint64 // last region stream sequence applied
	// Health is "ok", "stale" or "starting" as the instance reports it.
	Health           string
	InFlight         int64
	StalenessSeconds float64 // seconds since it last heard from the control plane
	Rejected         []RejectedSnapshot
	// Rejecting is set while the instance refuses its region's current
	// snapshot (nil otherwise).
	Rejecting *Rejecting
	// Ejected are the deployments the instance keeps out of rotation.
	Ejected []EjectedDeployment
	// Backlog is the instance's admission backlog per traffic class.
	Backlog []ClassBacklog
	// LastSeen is when the control plane stored the heartbeat (store
	// clock); DataPlaneUpsert sets it.
	LastSeen time.Time
}

// Lost reports whether no heartbeat of d arrived for DataPlaneLostAfter
// before now.
func (d DataPlane) Lost(now time.Time) bool { return now.Sub(d.LastSeen) > DataPlaneLostAfter }

// RejectedSnapshot is a snapshot a data plane refused to apply. It is
// stored as JSON in data_planes.rejected:
// [{"version":N,"reason":"...","time":"RFC3339"}].
type RejectedSnapshot struct {
	Version uint64    `json:"version"`
	Reason  string    `json:"reason"`
	Time    time.Time `json:"time"`
}

// Rejecting is an instance refusing, since Since, the snapshot its
// region's pointer names while it runs RunningVersion. It is stored as
// JSON in data_planes.rejecting.
type Rejecting struct {
	Version        uint64    `json:"version"`
	RunningVersion uint64    `json:"running_version"`
	Reason         string    `json:"reason"`
	Since          time.Time `json:"since"`
	PastBound      bool      `json:"past_bound"`
}

// EjectedDeployment is a deployment out of an instance's rotation, stored
// as JSON in data_planes.ejected.
type EjectedDeployment struct {
	DeploymentID string `json:"deployment_id"`
	ModelGroup   string `json:"model_group"`
	// Reason is "ejected", "parked" or "health_check".
	Reason string `json:"reason"`
	// Until is when it returns (nil: when a health check passes).
	Until *time.Time `json:"until,omitempty"`
}

// ClassBacklog is one traffic class's admission backlog on an instance,
// stored as JSON in data_planes.admission_backlog.
type ClassBacklog struct {
	// TrafficClass is "interactive", "agent" or "batch".
	TrafficClass string `json:"traffic_class"`
	InFlight     int64  `json:"in_flight"` // requests in flight at deployments
	Queued       int64  `json:"queued"`    // requests waiting in the admission queues
	Shed         uint64 `json:"shed"`      // requests shed since the instance started
}

// Bounds on what one heartbeat may store: heartbeats come from the
// network, so a broken instance must not grow a row without limit.
const (
	maxInstanceIDLen     = 200
	maxHealthLen         = 32
	maxRejectedSnapshots = 32
	maxRejectReasonLen   = 1000
	maxEjected           = 1000
	maxEjectedFieldLen   = 200
	// There are three traffic classes; the bound leaves room for more.
	maxBacklogClasses = 16
	maxClassNameLen   = 32
)

// ErrBadHeartbeat is wrapped by DataPlaneUpsert's errors for heartbeats it
// refuses to store.
var ErrBadHeartbeat = errors.New("bad heartbeat")

func dataPlaneFromRow(r dbsqlc.DataPlane) (DataPlane, error) {
	rej := []RejectedSnapshot{}
	if len(r.Rejected) > 0 {
		if err := json.Unmarshal(r.Rejected, &rej); err != nil {
			return DataPlane{}, fmt.Errorf("decode rejected snapshots of data plane %s: %w", r.InstanceID, err)
		}
	}
	var rejecting *Rejecting
	if len(r.Rejecting) > 0 && string(r.Rejecting) != "null" {
		rejecting = &Rejecting{}
		if err := json.Unmarshal(r.Rejecting, rejecting); err != nil {
			return DataPlane{}, fmt.Errorf("decode rejecting state of data plane %s: %w", r.InstanceID, err)
		}
	}
	ej := []EjectedDeployment{}
	if len(r.Ejected) > 0 {
		if err := json.Unmarshal(r.Ejected, &ej); err != nil {
			return DataPlane{}, fmt.Errorf("decode ejected deployments of data plane %s: %w", r.InstanceID, err)
		}
	}
	bl := []ClassBacklog{}
	if len(r.AdmissionBacklog) > 0 {
		if err := json.Unmarshal(r.AdmissionBacklog, &bl); err != nil {
			return DataPlane{}, fmt.Errorf("decode admission backlog of data plane %s: %w", r.InstanceID, err)
		}
	}
	return DataPlane{
		Ejected: ej, Backlog: bl,
		InstanceID: r.InstanceID, Region: r.Region, AppliedVersion: uint64(r.AppliedVersion),
		EventsSeq: uint64(r.EventsSeq), RegionSeq: uint64(r.RegionSeq), Health: r.Health,
		InFlight: r.InFlight, StalenessSeconds: r.StalenessSeconds, Rejected: rej, Rejecting: rejecting, LastSeen: r.LastSeen,
	}, nil
}

// DataPlaneUpsert records d's heartbeat, replacing the instance's previous
// one; d.LastSeen is ignored and set to the store clock, the clock the
// fleet view judges "lost" by. It is telemetry, not an admin change, so
// it is neither audited nor sent to the outbox.
func (s *Store) DataPlaneUpsert(ctx context.Context, d DataPlane) error {
	if err := checkHeartbeat(d); err != nil {
		return err
	}
	rej := d.Rejected
	if rej == nil {
		rej = []RejectedSnapshot{}
	}
	rejJSON, err := json.Marshal(rej)
	if err != nil {
		return fmt.Errorf("encode rejected snapshots: %w", err)
	}
	var rejectingJSON []byte
	if d.Rejecting != nil {
		if rejectingJSON, err = json.Marshal(d.Rejecting); err != nil {
			return fmt.Errorf("encode rejecting state: %w", err)
		}
	}
	ej := d.Ejected
	if ej == nil {
		ej = []EjectedDeployment{}
	}
	ejJSON, err := json.Marshal(ej)
	if err != nil {
		return fmt.Errorf("encode ejected deployments: %w", err)
	}
	bl := d.Backlog
	if bl == nil {
		bl = []ClassBacklog{}
	}
	blJSON, err := json.Marshal(bl)
	if err != nil {
		return fmt.Errorf("encode admission backlog: %w", err)
	}
	err = s.q.DataPlaneUpsert(ctx, s.pool, dbsqlc.DataPlaneUpsertParams{
		Ejected: ejJSON, AdmissionBacklog: blJSON,
		InstanceID: d.InstanceID, Region: d.Region, AppliedVersion: int64(d.AppliedVersion),
		EventsSeq: int64(d.EventsSeq), RegionSeq: int64(d.RegionSeq), Health: d.Health,
		InFlight: d.InFlight, StalenessSeconds: d.StalenessSeconds, Rejected: rejJSON, LastSeen: s.Now(),
		Rejecting: rejectingJSON,
	})
	if err != nil {
		return fmt.Errorf("upsert data plane %s: %w", d.InstanceID, err)
	}
	return nil
}

func checkHeartbeat(d DataPlane) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w from %q: %s", ErrBadHeartbeat, d.InstanceID, fmt.Sprintf(format, args...))
	}
	switch {
	case d.InstanceID == "" || len(d.InstanceID) > maxInstanceIDLen:
		return bad("instance id must be 1-%d bytes", maxInstanceIDLen)
	case !wire.ValidRegion(d.Region):
		return bad("region %q is not a valid region name", d.Region)
	case len(d.Health) > maxHealthLen:
		return bad("health is longer than %d bytes", maxHealthLen)
	case d.AppliedVersion > math.MaxInt64 || d.EventsSeq > math.MaxInt64 || d.RegionSeq > math.MaxInt64:
		return bad("version or sequence out of range")
	case math.IsNaN(d.StalenessSeconds) || math.IsInf(d.StalenessSeconds, 0):
		return bad("staleness is not a finite number")
	case len(d.Rejected) > maxRejectedSnapshots:
		return bad("more than %d rejected snapshots", maxRejectedSnapshots)
	case len(d.Ejected) > maxEjected:
		return bad("more than %d ejected deployments", maxEjected)
	case len(d.Backlog) > maxBacklogClasses:
		return bad("more than %d traffic classes in the admission backlog", maxBacklogClasses)
	}
	for _, b := range d.Backlog {
		if len(b.TrafficClass) > maxClassNameLen || b.InFlight < 0 || b.Queued < 0 || b.Shed > math.MaxInt64 {
			return bad("an admission backlog entry is out of range (class name over %d bytes or a negative count)", maxClassNameLen)
		}
	}
	for _, e := range d.Ejected {
		if len(e.DeploymentID) > maxEjectedFieldLen || len(e.ModelGroup) > maxEjectedFieldLen || len(e.Reason) > maxEjectedFieldLen {
			return bad("an ejected deployment's field is longer than %d bytes", maxEjectedFieldLen)
		}
	}
	for _, r := range d.Rejected {
		if len(r.Reason) > maxRejectReasonLen {
			return bad("a rejection reason is longer than %d bytes", maxRejectReasonLen)
		}
	}
	if r := d.Rejecting; r != nil {
		switch {
		case len(r.Reason) > maxRejectReasonLen:
			return bad("the rejecting reason is longer than %d bytes", maxRejectReasonLen)
		case r.Version > math.MaxInt64 || r.RunningVersion > math.MaxInt64:
			return bad("rejecting version out of range")
		}
	}
	return nil
}

// DataPlaneList returns the data planes of region ("" for every region),
// ordered by region and instance id.
func (s *Store) DataPlaneList(ctx context.Context, region string) ([]DataPlane, error) {
	rows, err := s.q.DataPlaneList(ctx, s.pool, optStr(region))
	if err != nil {
		return nil, fmt.Errorf("list data planes: %w", err)
	}
	out := make([]DataPlane, 0, len(rows))
	for _, r := range rows {
		d, err := dataPlaneFromRow(r)
		if err != nil {
			return nil, err
		}
		out = append(out, d)
	}
	return out, nil
}
