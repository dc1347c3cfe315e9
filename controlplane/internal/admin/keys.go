package admin

import "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"

// keyService implements KeyService.
type keyService struct {
	*Server
	adminv1connect.UnimplementedKeyServiceHandler
}
