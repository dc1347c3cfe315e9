package admin

import (
	"context"
	"errors"
	"fmt"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// fleetService implements FleetService and rolloutService RolloutService.
// The fleet and its regions are shared by every tenant, so both take
// platform-scoped tokens only: viewers read, editors and admins change.
type (
	fleetService   struct{ *Server }
	rolloutService struct{ *Server }
)

const objRegion = string(events.ObjRegion)

// healthLost is the health the fleet view reports for an instance whose
// heartbeats stopped (store.DataPlaneLostAfter).
const healthLost = "lost"

func policyToProto(p string) adminv1.RolloutPolicy {
	switch p {
	case store.RolloutAuto:
		return adminv1.RolloutPolicy_ROLLOUT_POLICY_AUTO
	case store.RolloutStaged:
		return adminv1.RolloutPolicy_ROLLOUT_POLICY_STAGED
	}
	return adminv1.RolloutPolicy_ROLLOUT_POLICY_UNSPECIFIED
}

func regionToProto(r store.Region) *adminv1.Region {
	return &adminv1.Region{Name: r.Name, Policy: policyToProto(r.Policy), CurrentVersion: r.CurrentVersion,
		UpdateTime: timestamppb.New(r.UpdatedAt)}
}

func configVersionToProto(v store.ConfigVersion) *adminv1.ConfigVersion {
	return &adminv1.ConfigVersion{Version: v.Version, EventsSeq: v.EventsSeq, Digest: v.Digest,
		SizeBytes: v.SizeBytes, CreateTime: timestamppb.New(v.CreatedAt)}
}

// dataPlaneToProto converts d as seen at now: an instance without a
// heartbeat for store.DataPlaneLostAfter is "lost" whatever it last said.
func dataPlaneToProto(d store.DataPlane, now time.Time) *adminv1.DataPlane {
	health := d.Health
	if d.Lost(now) {
		health = healthLost
	}
	out := &adminv1.DataPlane{
		InstanceId: d.InstanceID, Region: d.Region, AppliedVersion: d.AppliedVersion, EventsSeq: d.EventsSeq,
		Health: health, InFlight: d.InFlight, LastSeen: timestamppb.New(d.LastSeen),
		StalenessSeconds: d.StalenessSeconds,
	}
	for _, r := range d.Rejected {
		out.RejectedSnapshots = append(out.RejectedSnapshots, &adminv1.RejectedSnapshot{
			Version: r.Version, Reason: r.Reason, Time: timestamppb.New(r.Time),
		})
	}
	for _, e := range d.Ejected {
		ej := &adminv1.EjectedDeployment{DeploymentId: e.DeploymentID, ModelGroup: e.ModelGroup, Reason: e.Reason}
		if e.Until != nil {
			ej.Until = timestamppb.New(*e.Until)
		}
		out.EjectedDeployments = append(out.EjectedDeployments, ej)
	}
	for _, b := range d.Backlog {
		out.AdmissionBacklog = append(out.AdmissionBacklog, &adminv1.AdmissionBacklog{
			TrafficClass: b.TrafficClass, InFlight: b.InFlight, Queued: b.Queued, Shed: b.Shed,
		})
	}
	if r := d.Rejecting; r != nil {
		out.Rejecting = &adminv1.Rejecting{Version: r.Version, RunningVersion: r.RunningVersion, Reason: r.Reason,
			Since: timestamppb.New(r.Since), PastBound: r.PastBound}
	}
	return out
}

// validateRegionName checks a region name (the pattern of regions.name).
func validateRegionName(c *validator, field, name string) {
	switch {
	case name == "":
		c.add(field, "required")
	case !wire.ValidRegion(name):
		c.add(field, "must be 1-63 characters of a-z, 0-9 and '-', starting and ending with a letter or digit")
	}
}

func validateVersion(c *validator, field string, v uint64) {
	if v == 0 {
		c.add(field, "required: the config version to run (see GetRolloutStatus for the latest)")
	}
}

func (s *fleetService) ListDataPlanes(ctx context.Context, req *connect.Request[adminv1.ListDataPlanesRequest]) (*connect.Response[adminv1.ListDataPlanesResponse], error) {
	if err := authz.Check(ctx, principal(ctx), authz.Read, authz.PlatformTarget("the fleet")); err != nil {
		return nil, err
	}
	region := req.Msg.GetRegion()
	if region != "" {
		c := &validator{}
		validateRegionName(c, "region", region)
		if err := c.err(); err != nil {
			return nil, err
		}
	}
	rows, err := s.store.DataPlaneList(ctx, region)
	if err != nil {
		return nil, err
	}
	now := s.store.Now()
	resp := &adminv1.ListDataPlanesResponse{}
	for _, d := range rows {
		resp.DataPlanes = append(resp.DataPlanes, dataPlaneToProto(d, now))
	}
	return connect.NewResponse(resp), nil
}

func (s *rolloutService) UpsertRegion(ctx context.Context, req *connect.Request[adminv1.UpsertRegionRequest]) (*connect.Response[adminv1.UpsertRegionResponse], error) {
	if err := authz.Check(ctx, principal(ctx), authz.Write, authz.PlatformTarget("regions")); err != nil {
		return nil, err
	}
	name := req.Msg.GetName()
	c := &validator{}
	validateRegionName(c, "name", name)
	var policy string
	switch p := req.Msg.GetPolicy(); p {
	case adminv1.RolloutPolicy_ROLLOUT_POLICY_AUTO:
		policy = store.RolloutAuto
	case adminv1.RolloutPolicy_ROLLOUT_POLICY_STAGED:
		policy = store.RolloutStaged
	case adminv1.RolloutPolicy_ROLLOUT_POLICY_UNSPECIFIED:
		c.add("policy", "required: ROLLOUT_POLICY_AUTO or ROLLOUT_POLICY_STAGED")
	default:
		c.add("policy", "unknown value %d: want ROLLOUT_POLICY_AUTO or ROLLOUT_POLICY_STAGED", int32(p))
	}
	if err := c.err(); err != nil {
		return nil, err
	}
	var out *adminv1.Region
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.RegionGetForUpdate(ctx, name)
		var before []byte
		action := audit.ActionUpdated
		switch {
		case err == nil:
			before = auditJSON(regionToProto(cur))
			if err := tx.RegionSetPolicy(ctx, &cur, policy); err != nil {
				return err
			}
		case isNotFound(err):
			action = audit.ActionCreated
			cur = store.Region{Name: name, Policy: policy}
			if err := tx.RegionInsert(ctx, &cur); err != nil {
				return err
			}
		default:
			return err
		}
		out = regionToProto(cur)
		if err := tx.Audit(ctx, action, objRegion, name, "", "", before, auditJSON(out)); err != nil {
			return err
		}
		return outbox(ctx, tx, events.RegionPointer, "", name, events.RegionPointerPayload{Region: name})
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.UpsertRegionResponse{Region: out}), nil
}

func (s *rolloutService) GetRolloutStatus(ctx context.Context, _ *connect.Request[adminv1.GetRolloutStatusRequest]) (*connect.Response[adminv1.GetRolloutStatusResponse], error) {
	if err := authz.Check(ctx, principal(ctx), authz.Read, authz.PlatformTarget("the rollout status")); err != nil {
		return nil, err
	}
	resp := &adminv1.GetRolloutStatusResponse{}
	latest, ok, err := s.store.ConfigVersionLatest(ctx)
	if err != nil {
		return nil, err
	}
	if ok {
		resp.Latest = configVersionToProto(latest)
	}
	regions, err := s.store.RegionList(ctx)
	if err != nil {
		return nil, err
	}
	planes, err := s.store.DataPlaneList(ctx, "")
	if err != nil {
		return nil, err
	}
	now := s.store.Now()
	byRegion := map[string][]*adminv1.DataPlane{}
	for _, d := range planes {
		byRegion[d.Region] = append(byRegion[d.Region], dataPlaneToProto(d, now))
	}
	for _, r := range regions {
		resp.Regions = append(resp.Regions, &adminv1.RegionStatus{Region: regionToProto(r), DataPlanes: byRegion[r.Name]})
	}
	ep, ok, err := s.store.CurrentEpoch(ctx)
	if err != nil {
		return nil, err
	}
	if ok {
		resp.Epoch = &adminv1.DistributionEpoch{Epoch: uint64(ep.Epoch), StartTime: timestamppb.New(ep.StartedAt),
			VersionFloor: uint64(ep.VersionFloor), FirstVersion: uint64(ep.FirstVersion), EventsFloor: uint64(ep.EventsFloor),
			Reason: ep.Reason, Reapplied: ep.Detail.Reapplied}
	}
	return connect.NewResponse(resp), nil
}

func (s *rolloutService) PromoteVersion(ctx context.Context, req *connect.Request[adminv1.PromoteVersionRequest]) (*connect.Response[adminv1.PromoteVersionResponse], error) {
	out, err := s.setVersion(ctx, req.Msg.GetRegion(), req.Msg.GetVersion(), false)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.PromoteVersionResponse{Region: out}), nil
}

func (s *rolloutService) RollbackRegion(ctx context.Context, req *connect.Request[adminv1.RollbackRegionRequest]) (*connect.Response[adminv1.RollbackRegionResponse], error) {
	out, err := s.setVersion(ctx, req.Msg.GetRegion(), req.Msg.GetVersion(), true)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.RollbackRegionResponse{Region: out}), nil
}

// setVersion points region at version: a promotion (version not older than
// the current one) or a rollback (strictly older). The version must have
// been compiled with a stream position for the region, or the publisher
// could not tell data planes where the region's events continue.
func (s *rolloutService) setVersion(ctx context.Context, name string, version uint64, rollback bool) (*adminv1.Region, error) {
	what, action := "promoting a config version", audit.ActionPromoted
	if rollback {
		what, action = "rolling a region back", audit.ActionRolledBack
	}
	if err := authz.Check(ctx, principal(ctx), authz.Write, authz.PlatformTarget(what)); err != nil {
		return nil, err
	}
	c := &validator{}
	validateRegionName(c, "region", name)
	validateVersion(c, "version", version)
	if err := c.err(); err != nil {
		return nil, err
	}
	var out *adminv1.Region
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.RegionGetForUpdate(ctx, name)
		if err != nil {
			return err
		}
		if _, err := tx.ConfigVersionGet(ctx, version); err != nil {
			return err
		}
		if ep, ok, err := tx.CurrentEpoch(ctx); err != nil {
			return err
		} else if ok && int64(version) <= ep.VersionFloor {
			return failedPrecondition("config version %d predates distribution epoch %d (started %s: JetStream was ahead of this database); "+
				"its stream positions belong to the abandoned history: choose a version above %d",
				version, ep.Epoch, ep.StartedAt.UTC().Format(time.RFC3339), ep.VersionFloor)
		}
		switch {
		case !rollback && version < cur.CurrentVersion:
			return failedPrecondition("config version %d is older than region %s's current version %d; use RollbackRegion to go back to an older version",
				version, name, cur.CurrentVersion)
		case rollback && version >= cur.CurrentVersion:
			return failedPrecondition("config version %d is not older than region %s's current version %d; use PromoteVersion to move forward",
				version, name, cur.CurrentVersion)
		}
		if _, err := tx.ConfigVersionRegionSeq(ctx, version, name); err != nil {
			return err
		}
		before := auditJSON(regionToProto(cur))
		if err := tx.RegionSetVersion(ctx, &cur, version, rollback); err != nil {
			return err
		}
		out = regionToProto(cur)
		if err := tx.Audit(ctx, action, objRegion, name, "", "", before, auditJSON(out)); err != nil {
			return err
		}
		return outbox(ctx, tx, events.RegionPointer, "", name, events.RegionPointerPayload{Region: name})
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

func failedPrecondition(format string, args ...any) error {
	return &store.Error{Code: store.ErrFailedPrecondition, Msg: fmt.Sprintf(format, args...)}
}

func isNotFound(err error) bool {
	return errors.Is(err, store.ErrNotFound)
}
