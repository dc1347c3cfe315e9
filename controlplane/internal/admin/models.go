package admin

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/ids"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// modelService implements ModelService. Model groups and deployments are
// platform infrastructure: platform-scoped editors and admins change them;
// every admin token may read them (they carry no tenant data, and a
// deployment's credential is never returned, only has_credential).
type modelService struct{ *Server }

const (
	objModelGroup = "model_group"
	objDeployment = "deployment"
	// deploymentIDPrefix is the id prefix of deployments ("dep_...").
	deploymentIDPrefix = "dep"
)

// Deployment bounds. Prices are USD per token: a price above maxPrice is
// almost certainly a per-million price typed into a per-token field.
const (
	maxDescriptionLen = 1000
	maxAPIBaseLen     = 2000
	maxWeight         = 1000
	maxConcurrency    = 1_000_000
	maxTokensBound    = 1_000_000_000
	maxTags           = 32
	maxCredentialLen  = 4096
	maxPrice          = 1.0
)

// modelGroupNamePattern matches the model_groups.name check constraint.
// Deployment tags share keys' tagPattern.
var modelGroupNamePattern = regexp.MustCompile(`^[A-Za-z0-9._:/-]{1,100}$`)

// deploymentMaskPaths are the fields UpdateDeployment may change (besides
// "credential", which is not a Deployment field).
var deploymentMaskPaths = []string{"api_base", "upstream_model", "weight", "max_concurrency", "capabilities", "tags", "prices", "free"}

// readShared authorises reading a platform object every principal may
// see: the check runs against the principal's own scope, so it only
// requires the viewer role.
func readShared(ctx context.Context, what string) error {
	p := principal(ctx)
	t := authz.PlatformTarget(what)
	if p != nil {
		switch p.Scope {
		case authz.ScopeOrg:
			t = authz.OrgTarget(p.OrgID, what)
		case authz.ScopeTeam:
			t = authz.TeamTarget(p.OrgID, p.TeamID, what)
		}
	}
	return authz.Check(ctx, p, authz.Read, t)
}

func writeModels(ctx context.Context) error {
	return authz.Check(ctx, principal(ctx), authz.Write, authz.PlatformTarget("changing model groups and deployments"))
}

func modelGroupToProto(g store.ModelGroup) *adminv1.ModelGroup {
	return &adminv1.ModelGroup{Name: g.Name, Description: g.Description,
		CreateTime: timestamppb.New(g.CreatedAt), UpdateTime: timestamppb.New(g.UpdatedAt)}
}

func deploymentToProto(d store.Deployment) *adminv1.Deployment {
	c := d.Capabilities
	return &adminv1.Deployment{
		Id: d.ID, ModelGroup: d.ModelGroup, ApiBase: d.APIBase, UpstreamModel: d.UpstreamModel,
		HasCredential: len(d.CredentialCiphertext) > 0, Weight: d.Weight, MaxConcurrency: d.MaxConcurrency,
		Capabilities: &adminv1.Capabilities{Tools: c.Tools, JsonMode: c.JSONMode, Vision: c.Vision,
			MaxInputTokens: c.MaxInputTokens, MaxOutputTokens: c.MaxOutputTokens},
		Tags: slices.Clone(d.Tags),
		Prices: &adminv1.Prices{InputPerToken: d.InputPrice, OutputPerToken: d.OutputPrice,
			CachedInputPerToken: d.CachedInputPrice},
		Free: d.Free, CreateTime: timestamppb.New(d.CreatedAt), UpdateTime: timestamppb.New(d.UpdatedAt),
	}
}

// setDeploymentFields copies the settable fields of a validated API object
// into the stored deployment (the credential is handled separately).
func setDeploymentFields(d *store.Deployment, m *adminv1.Deployment) {
	c := m.GetCapabilities()
	d.APIBase, d.UpstreamModel, d.Weight, d.MaxConcurrency = m.GetApiBase(), m.GetUpstreamModel(), m.GetWeight(), m.GetMaxConcurrency()
	d.Capabilities = store.Capabilities{Tools: c.GetTools(), JSONMode: c.GetJsonMode(), Vision: c.GetVision(),
		MaxInputTokens: c.GetMaxInputTokens(), MaxOutputTokens: c.GetMaxOutputTokens()}
	d.Tags = slices.Clone(m.GetTags())
	p := m.GetPrices()
	d.InputPrice, d.OutputPrice, d.CachedInputPrice = p.GetInputPerToken(), p.GetOutputPerToken(), p.GetCachedInputPerToken()
	d.Free = m.GetFree()
}

func validModelGroupName(c *validator, field, name string) {
	if !modelGroupNamePattern.MatchString(name) {
		c.add(field, "model group name %q must be 1–100 characters of [A-Za-z0-9._:/-]", name)
	}
}

func validateDescription(c *validator, s string) {
	if !utf8.ValidString(s) || utf8.RuneCountInString(s) > maxDescriptionLen {
		c.add("description", "must be at most %d characters of valid UTF-8", maxDescriptionLen)
	}
}

// validateAPIBase checks an upstream base URL: http or https, a host, and
// no credentials, query or fragment (credentials belong in `credential`,
// which is encrypted at rest; a URL is stored and shown in clear).
func validateAPIBase(c *validator, s string) {
	if s == "" {
		c.add("api_base", "required: the upstream's OpenAI-compatible base URL, e.g. http://vllm-a:8000/v1")
		return
	}
	if len(s) > maxAPIBaseLen {
		c.add("api_base", "must be at most %d bytes", maxAPIBaseLen)
		return
	}
	u, err := url.Parse(s)
	switch {
	case err != nil:
		c.add("api_base", "is not a URL")
	case u.Scheme != "http" && u.Scheme != "https":
		c.add("api_base", "must be an http:// or https:// URL (got scheme %q)", u.Scheme)
	case u.Host == "" || u.Hostname() == "":
		c.add("api_base", "must name a host")
	case u.User != nil:
		c.add("api_base", "must not contain credentials; give the upstream credential in `credential` (it is encrypted at rest)")
	case u.RawQuery != "" || u.ForceQuery || u.Fragment != "":
		c.add("api_base", "must not have a query or fragment")
	}
}

func validPrice(c *validator, field string, v float64) {
	switch {
	case math.IsNaN(v) || math.IsInf(v, 0):
		c.add(field, "must be a finite number")
	case v < 0:
		c.add(field, "must not be negative (got %g)", v)
	case v > maxPrice:
		c.add(field, "must be at most %g USD per token (got %g); prices are per token, e.g. 0.000002 for $2 per million tokens", float64(maxPrice), v)
	}
}

func validTokens(c *validator, field string, v int64) {
	switch {
	case v < 0:
		c.add(field, "must not be negative (got %d); 0 means no limit", v)
	case v > maxTokensBound:
		c.add(field, "must be at most %d (got %d)", maxTokensBound, v)
	}
}

// validateDeployment checks the settable fields of d (weight already
// defaulted). Prices are required unless the deployment is declared free,
// and a free deployment has no prices.
func validateDeployment(c *validator, d *adminv1.Deployment) {
	validateAPIBase(c, d.GetApiBase())
	validModelName(c, "upstream_model", d.GetUpstreamModel())
	if w := d.GetWeight(); w < 1 || w > maxWeight {
		c.add("weight", "must be 1–%d (got %d); 0 means 1", maxWeight, w)
	}
	if m := d.GetMaxConcurrency(); m < 0 || m > maxConcurrency {
		c.add("max_concurrency", "must be 0 (no cap) to %d (got %d)", maxConcurrency, m)
	}
	validTokens(c, "capabilities.max_input_tokens", d.GetCapabilities().GetMaxInputTokens())
	validTokens(c, "capabilities.max_output_tokens", d.GetCapabilities().GetMaxOutputTokens())
	if len(d.GetTags()) > maxTags {
		c.add("tags", "at most %d tags (got %d)", maxTags, len(d.GetTags()))
	}
	seen := map[string]bool{}
	for i, t := range d.GetTags() {
		f := fmt.Sprintf("tags[%d]", i)
		if !tagPattern.MatchString(t) {
			c.add(f, "tag %q must be 1–64 characters of [A-Za-z0-9_.:/-]", t)
		}
		if seen[t] {
			c.add(f, "duplicate tag %q", t)
		}
		seen[t] = true
	}
	p := d.GetPrices()
	validPrice(c, "prices.input_per_token", p.GetInputPerToken())
	validPrice(c, "prices.output_per_token", p.GetOutputPerToken())
	validPrice(c, "prices.cached_input_per_token", p.GetCachedInputPerToken())
	priced := p.GetInputPerToken() > 0 || p.GetOutputPerToken() > 0
	anyPrice := priced || p.GetCachedInputPerToken() > 0
	switch {
	case d.GetFree() && anyPrice:
		c.add("prices", "must be zero or unset on a free deployment; clear `free` to charge for it")
	case !d.GetFree() && !priced:
		c.add("prices", "required: set input_per_token and/or output_per_token (USD per token), or declare the deployment free (`free`)")
	}
}

// validateCredential bounds an upstream credential. It never echoes the
// value.
func validateCredential(c *validator, cred string) {
	if len(cred) > maxCredentialLen {
		c.add("credential", "must be at most %d bytes (got %d)", maxCredentialLen, len(cred))
		return
	}
	if strings.TrimSpace(cred) != cred {
		c.add("credential", "must not have surrounding spaces")
	}
	if strings.ContainsFunc(cred, unicode.IsControl) || !utf8.ValidString(cred) {
		c.add("credential", "must be valid UTF-8 without control characters")
	}
}

// errNoKeyRing is returned when a credential must be sealed but the
// server has no key ring (the control plane always configures one).
var errNoKeyRing = connect.NewError(connect.CodeFailedPrecondition,
	errors.New("no key ring is configured (SLUICE_KEK); upstream credentials cannot be stored"))

// seal encrypts a credential for storage ("" gives nil: no credential).
func (s *modelService) seal(cred string) ([]byte, error) {
	if cred == "" {
		return nil, nil
	}
	if s.keys == nil {
		return nil, errNoKeyRing
	}
	return s.keys.Seal([]byte(cred)), nil
}

func modelGroupEvent(kind, name string) store.OutboxEvent {
	return store.OutboxEvent{Kind: kind, ObjectType: objModelGroup, ObjectID: name}
}

func deploymentEvent(kind, id string) store.OutboxEvent {
	return store.OutboxEvent{Kind: kind, ObjectType: objDeployment, ObjectID: id}
}

func (s *modelService) CreateModelGroup(ctx context.Context, req *connect.Request[adminv1.CreateModelGroupRequest]) (*connect.Response[adminv1.CreateModelGroupResponse], error) {
	if err := writeModels(ctx); err != nil {
		return nil, err
	}
	c := &validator{}
	validModelGroupName(c, "name", req.Msg.GetName())
	validateDescription(c, req.Msg.GetDescription())
	if err := c.err(); err != nil {
		return nil, err
	}
	g := store.ModelGroup{Name: req.Msg.GetName(), Description: req.Msg.GetDescription()}
	var out *adminv1.ModelGroup
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		if err := tx.ModelGroupInsert(ctx, &g); err != nil {
			return err
		}
		out = modelGroupToProto(g)
		if err := tx.Audit(ctx, audit.ActionCreated, objModelGroup, g.Name, "", "", nil, auditJSON(out)); err != nil {
			return err
		}
		return tx.Outbox(ctx, modelGroupEvent(store.EventModelGroupUpserted, g.Name))
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.CreateModelGroupResponse{ModelGroup: out}), nil
}

func (s *modelService) GetModelGroup(ctx context.Context, req *connect.Request[adminv1.GetModelGroupRequest]) (*connect.Response[adminv1.GetModelGroupResponse], error) {
	if err := readShared(ctx, "model groups"); err != nil {
		return nil, err
	}
	g, err := s.store.ModelGroupGet(ctx, req.Msg.GetName())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.GetModelGroupResponse{ModelGroup: modelGroupToProto(g)}), nil
}

func (s *modelService) ListModelGroups(ctx context.Context, req *connect.Request[adminv1.ListModelGroupsRequest]) (*connect.Response[adminv1.ListModelGroupsResponse], error) {
	if err := readShared(ctx, "model groups"); err != nil {
		return nil, err
	}
	limit, after, err := pageArgs(req.Msg.GetPageSize(), req.Msg.GetPageToken())
	if err != nil {
		return nil, err
	}
	rows, err := s.store.ModelGroupList(ctx, store.Page{After: after, Limit: limit})
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListModelGroupsResponse{}
	for _, g := range rows {
		resp.ModelGroups = append(resp.ModelGroups, modelGroupToProto(g))
	}
	if len(rows) > 0 {
		resp.NextPageToken = nextPageToken(len(rows), limit, rows[len(rows)-1].Name)
	}
	return connect.NewResponse(resp), nil
}

func (s *modelService) UpdateModelGroup(ctx context.Context, req *connect.Request[adminv1.UpdateModelGroupRequest]) (*connect.Response[adminv1.UpdateModelGroupResponse], error) {
	if err := writeModels(ctx); err != nil {
		return nil, err
	}
	name := req.Msg.GetModelGroup().GetName()
	var out *adminv1.ModelGroup
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.ModelGroupGetForUpdate(ctx, name)
		if err != nil {
			return err
		}
		before := modelGroupToProto(cur)
		after := proto.Clone(before).(*adminv1.ModelGroup)
		if err := applyMask(after, req.Msg.GetModelGroup(), req.Msg.GetUpdateMask(), "description"); err != nil {
			return err
		}
		c := &validator{}
		validateDescription(c, after.GetDescription())
		if err := c.err(); err != nil {
			return err
		}
		cur.Description = after.GetDescription()
		if err := tx.ModelGroupUpdate(ctx, &cur); err != nil {
			return err
		}
		out = modelGroupToProto(cur)
		if err := tx.Audit(ctx, audit.ActionUpdated, objModelGroup, cur.Name, "", "", auditJSON(before), auditJSON(out)); err != nil {
			return err
		}
		return tx.Outbox(ctx, modelGroupEvent(store.EventModelGroupUpserted, cur.Name))
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.UpdateModelGroupResponse{ModelGroup: out}), nil
}

func (s *modelService) DeleteModelGroup(ctx context.Context, req *connect.Request[adminv1.DeleteModelGroupRequest]) (*connect.Response[adminv1.DeleteModelGroupResponse], error) {
	if err := writeModels(ctx); err != nil {
		return nil, err
	}
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.ModelGroupGetForUpdate(ctx, req.Msg.GetName())
		if err != nil {
			return err
		}
		if err := tx.ModelGroupDelete(ctx, cur.Name); err != nil {
			return err
		}
		if err := tx.Audit(ctx, audit.ActionDeleted, objModelGroup, cur.Name, "", "", auditJSON(modelGroupToProto(cur)), nil); err != nil {
			return err
		}
		return tx.Outbox(ctx, modelGroupEvent(store.EventModelGroupDeleted, cur.Name))
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.DeleteModelGroupResponse{}), nil
}

func (s *modelService) CreateDeployment(ctx context.Context, req *connect.Request[adminv1.CreateDeploymentRequest]) (*connect.Response[adminv1.CreateDeploymentResponse], error) {
	if err := writeModels(ctx); err != nil {
		return nil, err
	}
	m := req.Msg
	want := &adminv1.Deployment{
		ModelGroup: m.GetModelGroup(), ApiBase: m.GetApiBase(), UpstreamModel: m.GetUpstreamModel(),
		Weight: m.GetWeight(), MaxConcurrency: m.GetMaxConcurrency(), Capabilities: m.GetCapabilities(),
		Tags: m.GetTags(), Prices: m.GetPrices(), Free: m.GetFree(),
	}
	if want.Weight == 0 {
		want.Weight = 1
	}
	c := &validator{}
	validModelGroupName(c, "model_group", want.GetModelGroup())
	validateDeployment(c, want)
	validateCredential(c, m.GetCredential())
	if err := c.err(); err != nil {
		return nil, err
	}
	ct, err := s.seal(m.GetCredential())
	if err != nil {
		return nil, err
	}
	d := store.Deployment{ID: ids.New(deploymentIDPrefix), ModelGroup: want.GetModelGroup(), CredentialCiphertext: ct}
	setDeploymentFields(&d, want)
	var out *adminv1.Deployment
	err = s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		if _, err := tx.ModelGroupGet(ctx, d.ModelGroup); err != nil {
			return err
		}
		if err := tx.DeploymentInsert(ctx, &d); err != nil {
			return err
		}
		out = deploymentToProto(d)
		if err := tx.Audit(ctx, audit.ActionCreated, objDeployment, d.ID, "", "", nil, auditJSON(out)); err != nil {
			return err
		}
		return tx.Outbox(ctx, deploymentEvent(store.EventDeploymentUpserted, d.ID))
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.CreateDeploymentResponse{Deployment: out}), nil
}

func (s *modelService) GetDeployment(ctx context.Context, req *connect.Request[adminv1.GetDeploymentRequest]) (*connect.Response[adminv1.GetDeploymentResponse], error) {
	if err := readShared(ctx, "deployments"); err != nil {
		return nil, err
	}
	d, err := s.store.DeploymentGet(ctx, req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.GetDeploymentResponse{Deployment: deploymentToProto(d)}), nil
}

func (s *modelService) ListDeployments(ctx context.Context, req *connect.Request[adminv1.ListDeploymentsRequest]) (*connect.Response[adminv1.ListDeploymentsResponse], error) {
	if err := readShared(ctx, "deployments"); err != nil {
		return nil, err
	}
	limit, after, err := pageArgs(req.Msg.GetPageSize(), req.Msg.GetPageToken())
	if err != nil {
		return nil, err
	}
	if g := req.Msg.GetModelGroup(); g != "" {
		// A filter naming no group is a mistake worth saying, not an
		// empty list.
		if _, err := s.store.ModelGroupGet(ctx, g); err != nil {
			return nil, err
		}
	}
	rows, err := s.store.DeploymentList(ctx, store.DeploymentQuery{ModelGroup: req.Msg.GetModelGroup()}, store.Page{After: after, Limit: limit})
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListDeploymentsResponse{}
	for _, d := range rows {
		resp.Deployments = append(resp.Deployments, deploymentToProto(d))
	}
	if len(rows) > 0 {
		resp.NextPageToken = nextPageToken(len(rows), limit, rows[len(rows)-1].ID)
	}
	return connect.NewResponse(resp), nil
}

// splitCredentialPath removes "credential" from mask: it names the
// request's write-only credential field, not a Deployment field.
func splitCredentialPath(mask *fieldmaskpb.FieldMask) (*fieldmaskpb.FieldMask, bool) {
	rest := &fieldmaskpb.FieldMask{}
	found := false
	for _, p := range mask.GetPaths() {
		if p == "credential" {
			found = true
			continue
		}
		rest.Paths = append(rest.Paths, p)
	}
	return rest, found
}

func (s *modelService) UpdateDeployment(ctx context.Context, req *connect.Request[adminv1.UpdateDeploymentRequest]) (*connect.Response[adminv1.UpdateDeploymentResponse], error) {
	if err := writeModels(ctx); err != nil {
		return nil, err
	}
	mask, setCred := splitCredentialPath(req.Msg.GetUpdateMask())
	cred := req.Msg.GetCredential()
	if cred != "" && !setCred {
		return nil, invalid("credential", `given, but "credential" is not in update_mask`)
	}
	var ct []byte
	if setCred {
		c := &validator{}
		validateCredential(c, cred)
		if err := c.err(); err != nil {
			return nil, err
		}
		var err error
		if ct, err = s.seal(cred); err != nil {
			return nil, err
		}
	}
	var out *adminv1.Deployment
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.DeploymentGetForUpdate(ctx, req.Msg.GetDeployment().GetId())
		if err != nil {
			return err
		}
		before := deploymentToProto(cur)
		after := proto.Clone(before).(*adminv1.Deployment)
		if len(mask.GetPaths()) > 0 || !setCred {
			if err := applyMask(after, req.Msg.GetDeployment(), mask, deploymentMaskPaths...); err != nil {
				return err
			}
		}
		if after.Weight == 0 {
			after.Weight = 1
		}
		c := &validator{}
		validateDeployment(c, after)
		if err := c.err(); err != nil {
			return err
		}
		setDeploymentFields(&cur, after)
		if setCred {
			cur.CredentialCiphertext = ct
		}
		if err := tx.DeploymentUpdate(ctx, &cur); err != nil {
			return err
		}
		out = deploymentToProto(cur)
		if err := tx.Audit(ctx, audit.ActionUpdated, objDeployment, cur.ID, "", "", auditJSON(before), auditJSON(out)); err != nil {
			return err
		}
		return tx.Outbox(ctx, deploymentEvent(store.EventDeploymentUpserted, cur.ID))
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.UpdateDeploymentResponse{Deployment: out}), nil
}

func (s *modelService) DeleteDeployment(ctx context.Context, req *connect.Request[adminv1.DeleteDeploymentRequest]) (*connect.Response[adminv1.DeleteDeploymentResponse], error) {
	if err := writeModels(ctx); err != nil {
		return nil, err
	}
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.DeploymentGetForUpdate(ctx, req.Msg.GetId())
		if err != nil {
			return err
		}
		if err := tx.DeploymentDelete(ctx, cur.ID); err != nil {
			return err
		}
		if err := tx.Audit(ctx, audit.ActionDeleted, objDeployment, cur.ID, "", "", auditJSON(deploymentToProto(cur)), nil); err != nil {
			return err
		}
		return tx.Outbox(ctx, deploymentEvent(store.EventDeploymentDeleted, cur.ID))
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.DeleteDeploymentResponse{}), nil
}
